"""Stage configuration: one TOML file loaded into a frozen, validated dataclass tree.

One file configures one stage process: which
model and layers it owns (``[stage]``), how llama.cpp runs them (``[runtime]``), the
OpenAI-compatible API of the first stage (``[http]``), the local control socket
(``[control]``), logging (``[telemetry]``), the prefix cache (``[kv_cache]``) and the
stage-to-stage link (``[link]``, ``[upstream]``, ``[downstream]``).

:func:`load_config` and :func:`parse_config` collect every problem before raising one
:class:`ConfigError` whose issues name their key path (``runtime.lane_count``).
Defaults that depend on other values or on the machine (threads, the control socket,
the model id) are resolved while parsing, so a loaded config holds concrete values and
:func:`config_to_toml` writes it back as an equal config. ``stage.layer_end`` and
``runtime.ctx_size`` may stay open until the model is known (:func:`check_layer_range`,
:func:`resolve_context`).

Modules: ``schema`` (the tree and per-key rules), ``loader`` (parsing, overrides),
``rules`` (cross-key and pipeline rules), ``dump`` (writing), ``defaults`` (machine
defaults), ``errors``. Imports nothing from the rest of skippyd: every room may use it.
"""

from skippyd.config.defaults import (
    DEFAULT_MODEL_FILE,
    MODEL_PACKAGE,
    available_cpus,
    available_memory_bytes,
    candidate_socket_paths,
    default_model_path,
    default_socket_path,
    model_id_for,
)
from skippyd.config.dump import config_to_dict, config_to_toml, example_config_toml
from skippyd.config.errors import ConfigError, ConfigIssue
from skippyd.config.loader import (
    OVERRIDE_KEYS,
    apply_overrides,
    check_layer_range,
    default_config,
    load_config,
    parse_config,
    resolve_context,
)
from skippyd.config.rules import check_pipeline
from skippyd.config.schema import (
    FLASH_ATTN_TYPE_IDS,
    GGML_TYPE_IDS,
    LOG_LEVELS,
    MAX_LANES,
    CacheType,
    ControlSection,
    FlashAttn,
    HttpSection,
    KvCacheMode,
    KvCachePayload,
    KvCacheSection,
    LinkSection,
    LogFormat,
    LogLevel,
    PeerConfig,
    RuntimeSection,
    SpeculativeSection,
    StageConfig,
    StageSection,
    TelemetryLevel,
    TelemetrySection,
    parse_host_port,
)

__all__ = [
    "DEFAULT_MODEL_FILE",
    "FLASH_ATTN_TYPE_IDS",
    "GGML_TYPE_IDS",
    "LOG_LEVELS",
    "MAX_LANES",
    "MODEL_PACKAGE",
    "OVERRIDE_KEYS",
    "CacheType",
    "ConfigError",
    "ConfigIssue",
    "ControlSection",
    "FlashAttn",
    "HttpSection",
    "KvCacheMode",
    "KvCachePayload",
    "KvCacheSection",
    "SpeculativeSection",
    "LinkSection",
    "LogFormat",
    "LogLevel",
    "PeerConfig",
    "RuntimeSection",
    "StageConfig",
    "StageSection",
    "TelemetryLevel",
    "TelemetrySection",
    "apply_overrides",
    "available_cpus",
    "available_memory_bytes",
    "candidate_socket_paths",
    "check_layer_range",
    "resolve_context",
    "check_pipeline",
    "config_to_dict",
    "config_to_toml",
    "default_config",
    "default_model_path",
    "default_socket_path",
    "example_config_toml",
    "load_config",
    "model_id_for",
    "parse_config",
    "parse_host_port",
]
