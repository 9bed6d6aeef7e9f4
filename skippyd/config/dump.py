"""Write a :class:`StageConfig` back out: as a dict, as TOML, and as a commented example."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import tomli_w

from skippyd.config.loader import default_config
from skippyd.config.schema import SECTIONS, StageConfig

logger = logging.getLogger(__name__)

_EXAMPLE_HEADER = """\
# skippyd stage configuration, with every key.
#
# Uncommented keys show their defaults. Commented keys are optional, or their default
# is computed from other keys or from the machine; uncomment them to set a value.
# A real file needs only the keys that differ from the defaults.
"""
_SECTION_NOTES: dict[str, str] = {
    "stage": "The model this process serves and the layers [layer_start, layer_end) it owns.",
    "runtime": "The llama.cpp context and the iteration scheduler.",
    "http": "OpenAI-compatible API, served by the first stage only.",
    "sampling": "Sampling of API requests that leave a field out (llama-server's defaults).",
    "control": "Local Unix socket for `skippyd top`.",
    "telemetry": "Event detail, logs, and a /metrics listener (for stages without [http]).",
    "kv_cache": "Prefix cache.",
    "speculative": "Speculative decoding (stage 0 of an unsplit model).",
    "link": "Stage-to-stage TCP link of a split pipeline. The secret is shared by all stages.",
    "upstream": "The previous stage: required on every stage but the first.",
    "downstream": "The next stage: leave it out on the final stage.",
}
# Sample values of keys that are optional or whose default is computed at load time.
_COMMENTED: dict[str, Any] = {
    "stage.model_id": "my-model.Q4_K_M",
    "stage.model_path": "models/my-model.Q4_K_M.gguf",
    "stage.layer_end": 30,
    "runtime.ctx_size": 8192,
    "runtime.threads": 8,
    "runtime.threads_batch": 8,
    "runtime.slice_cache_dir": "~/.cache/skippyd/slices",
    "runtime.tensor_split": "3,1",
    "runtime.pipeline_decode_groups": 2,
    "http.api_key": "change-me",
    "http.model_alias": "my-model",
    "http.max_prompt_tokens": 4096,
    "http.default_max_tokens": 512,
    "http.chat_template_file": "templates/chatml.jinja",
    "control.socket": "/run/skippyd/stage-0.sock",
    "control.group": "skippyd",
    "telemetry.metrics_listen": "127.0.0.1:9190",
    "speculative.draft_model_path": "models/my-draft-model.Q8_0.gguf",
    "link.listen": "0.0.0.0:9101",
    "link.secret": "change-me-to-a-long-random-string",
    "link.advertise": "tcp://203.0.113.7:9102",
    "link.status_secret": "a-different-read-only-credential",
    "link.tls_ca": "tls/ca.crt",
    "link.tls_cert": "tls/stage-0.crt",
    "link.tls_key": "tls/stage-0.key",
    "upstream.stage_id": "stage-0",
    "upstream.stage_index": 0,
    "upstream.endpoint": "tcp://10.0.0.1:9101",
    "downstream.stage_id": "stage-1",
    "downstream.stage_index": 1,
    "downstream.endpoint": "tcp://10.0.0.2:9102",
}

_KEY_NOTES: dict[str, str] = {
    "stage.model_id": "default: the model file name without .gguf",
    "stage.model_path": "default: the embedded SmolLM2-135M model",
    "stage.layer_end": "default: the model's last layer",
    "runtime.threads": "default: the CPUs available to the process",
    "runtime.threads_batch": "default: threads",
    "runtime.pipeline_decode_groups": "default: sized by stage 0's timed decode steps, at "
                                      "most one per stage of a split pipeline, plus one",
    "http.max_prompt_tokens": "default: what one request may hold",
    "runtime.ctx_size": "default: the model's trained context, within half the free memory",
    "http.default_max_tokens": "default: until the end of generation or a full context",
    "http.chat_template_file": "default: the model's own chat template",
    "link.tls_ca": "with link.tls = true; skippyd link keygen DIR --stages N writes them",
    "control.socket": "default: $XDG_RUNTIME_DIR/skippyd/<stage id>.sock, else "
                      "$RUNTIME_DIRECTORY/<stage id>.sock, else a per-user temp dir",
}


def config_to_dict(config: StageConfig) -> dict[str, dict[str, Any]]:
    """The config's resolved values as plain tables, ready for JSON or TOML.

    ``None`` values and absent sections (``http`` on later stages, missing peers) are
    left out, since TOML has no null; loading the result gives back an equal config.
    """
    tables: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        section = getattr(config, name)
        if section is not None:
            values = dataclasses.asdict(section)
            tables[name] = {key: value for key, value in values.items() if value is not None}
    return tables


def config_to_toml(config: StageConfig) -> str:
    """The config's resolved values as a TOML document (see :func:`config_to_dict`)."""
    return tomli_w.dumps(config_to_dict(config))


def example_config_toml() -> str:
    """A complete, commented example config; it loads as :func:`default_config`."""
    defaults = config_to_dict(default_config())
    blocks = [_EXAMPLE_HEADER]
    for name, cls in SECTIONS.items():
        blocks.append(_example_section(name, cls, defaults.get(name)))
    return "\n".join(blocks)


def _example_section(name: str, cls: type, values: dict[str, Any] | None) -> str:
    prefix = "" if values is not None else "# "
    lines = [f"# {_SECTION_NOTES[name]}", f"{prefix}[{name}]"]
    for spec in dataclasses.fields(cls):
        dotted = f"{name}.{spec.name}"
        if dotted in _KEY_NOTES:
            lines.append(f"# ({_KEY_NOTES[dotted]})")
        if dotted in _COMMENTED:
            lines.append("# " + _toml_line(spec.name, _COMMENTED[dotted]))
        elif values is not None and spec.name in values:
            lines.append(_toml_line(spec.name, values[spec.name]))
    return "\n".join(lines) + "\n"


def _toml_line(key: str, value: Any) -> str:
    return tomli_w.dumps({key: value}).rstrip("\n")
