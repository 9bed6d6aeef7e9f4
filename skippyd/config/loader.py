"""Turn TOML (or a parsed dict) into a validated :class:`StageConfig`.

Checking runs in three passes that all report into one :class:`IssueCollector`: the
top-level sections, then each key against its field (type, choice, range, format), then
the cross-field rules of :mod:`skippyd.config.rules`. Only when every pass is clean is a
config returned; otherwise one :class:`ConfigError` lists every issue.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import logging
import math
import os
import tomllib
import types
from collections.abc import Mapping
from dataclasses import MISSING, Field, fields, replace
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from skippyd.config.defaults import available_cpus, default_socket_path, model_id_for
from skippyd.config.environment import apply_environment
from skippyd.config.errors import ConfigError, ConfigIssue, IssueCollector
from skippyd.config.rules import check_rules
from skippyd.config.schema import (
    CACHE_TYPE_BYTES,
    SECTIONS,
    ControlSection,
    HttpSection,
    KvCacheSection,
    LinkSection,
    PeerConfig,
    RuntimeSection,
    SamplingSection,
    SpeculativeSection,
    StageConfig,
    StageSection,
    TelemetrySection,
    show_value,
)

logger = logging.getLogger(__name__)

#: Short names :func:`apply_overrides` accepts, mapped to their key paths.
OVERRIDE_KEYS: dict[str, str] = {
    "listen": "http.listen",
    "api_key": "http.api_key",
    "model_path": "stage.model_path",
    "ctx_size": "runtime.ctx_size",
    "lane_count": "runtime.lane_count",
    "threads": "runtime.threads",
    "log_level": "telemetry.log_level",
    "layer_start": "stage.layer_start",
    "layer_end": "stage.layer_end",
    "chat_template_file": "http.chat_template_file",
}
# Path keys that load_config resolves against the directory of the config file.
_PATH_KEYS = (("stage", "model_path"), ("runtime", "slice_cache_dir"), ("control", "socket"),
              ("http", "chat_template_file"), ("link", "tls_ca"), ("link", "tls_cert"),
              ("link", "tls_key"))
_TYPE_LABELS: dict[type, str] = {
    bool: "a boolean", int: "an integer", float: "a number", str: "a string",
}


def load_config(path: str | os.PathLike[str]) -> StageConfig:
    """Read and validate a TOML stage config.

    Relative paths in the file (``stage.model_path``, ``runtime.slice_cache_dir``,
    ``control.socket``, ``http.chat_template_file``, ``link.tls_*``) are taken relative
    to the file's directory; ``~`` is expanded.

    Args:
        path: The TOML file.

    Returns:
        The validated config, with every default resolved except ``stage.layer_end``
        (see :func:`check_layer_range`).

    Raises:
        ConfigError: The file is missing, unreadable, not TOML, or not a valid config;
            every problem found is listed.
    """
    file = Path(path)
    source = str(path)
    data = _read_toml(file, source)
    config = parse_config(_resolve_paths(data, file.absolute().parent), source)
    logger.debug("loaded config %s for stage %s", source, config.stage.id)
    return config


def parse_config(data: Mapping[str, Any], source: str = "<config>",
                 environ: Mapping[str, str] | None = None) -> StageConfig:
    """Validate a parsed TOML document (a dict of section tables).

    The environment switches of :mod:`skippyd.config.environment` are folded in first.

    Args:
        data: The document, as ``tomllib`` returns it.
        source: Names the input in the raised error.
        environ: Environment to read; defaults to ``os.environ``.

    Raises:
        ConfigError: Listing every problem found.
    """
    data = apply_environment(data, environ)
    issues = IssueCollector()
    tables = _section_tables(data, issues)
    given = {name: _parse_table(name, table, issues) for name, table in tables.items()}
    config = _build(given, issues, raw=copy.deepcopy(dict(data)))
    check_rules(config, set(tables), issues)
    if issues:
        raise ConfigError(issues.items, source)
    if config.link.secret is not None and "change-me" in config.link.secret.lower():
        logger.warning("%s: link.secret is still the example value; change it", source)
    return config


def default_config() -> StageConfig:
    """The config of ``skippyd serve`` without a file: one stage, the embedded model."""
    return parse_config({}, "<defaults>")


def apply_overrides(config: StageConfig, **overrides: Any) -> StageConfig:
    """Replace some keys and validate the result again.

    Overrides start from the input ``config`` was parsed from (``config.raw``), so
    defaults that follow other keys follow the overrides too (``http.max_prompt_tokens``
    follows ``ctx_size``). ``None`` values are ignored, so CLI options that were not
    given can be passed through as they are. Changes made to ``config`` with
    ``dataclasses.replace`` (such as the ``layer_end`` that :func:`check_layer_range`
    resolves) are not in ``config.raw``: apply overrides first.

    Args:
        config: A config made by this module.
        **overrides: Short names from :data:`OVERRIDE_KEYS` (``listen``, ``ctx_size``,
            ...) or full key paths such as ``**{"runtime.n_batch": 1024}``.

    Raises:
        TypeError: An override name is neither a short name nor ``section.key``.
        ConfigError: The overridden config is invalid.
    """
    data = copy.deepcopy(dict(config.raw))
    for name, value in overrides.items():
        if value is None:
            continue
        section, key = _override_target(name)
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        data.setdefault(section, {})[key] = value
    return parse_config(data, "<overrides>")


#: Share of the memory available at start a default-sized KV cache may take.
KV_MEMORY_SHARE = 0.5
#: Context of a model whose metadata does not say what it was trained for.
FALLBACK_CONTEXT = 4096
#: llama.cpp pads a context to a multiple of this many cells.
CONTEXT_STEP = 256


def resolve_context(config: StageConfig, *, n_ctx_train: int | None, kv_values_per_token: int,
                    available_bytes: int | None) -> tuple[StageConfig, str | None]:
    """Size ``runtime.ctx_size`` from the model when the config leaves it open.

    Every request may hold the model's trained context: each lane gets it (``per_lane``)
    or the one pool does (``unified``), capped so the KV cache takes at most
    :data:`KV_MEMORY_SHARE` of ``available_bytes``.

    Args:
        config: A validated config.
        n_ctx_train: The context the model was trained for, if its metadata says.
        kv_values_per_token: K and V values one token takes over this stage's layers.
        available_bytes: Memory available beside the model; None if unknown.

    Returns:
        The config with ``ctx_size`` set, and a sentence saying what was chosen and
        why (None when the config set it).
    """
    runtime = config.runtime
    if runtime.ctx_size is not None:
        return config, None
    trained = n_ctx_train if n_ctx_train and n_ctx_train > 0 else FALLBACK_CONTEXT
    value_bytes = (CACHE_TYPE_BYTES[runtime.cache_type_k]
                   + CACHE_TYPE_BYTES[runtime.cache_type_v]) / 2
    cell_bytes = max(1.0, kv_values_per_token * value_bytes)
    streams = runtime.lane_count if runtime.kv_layout == "per_lane" else 1
    each = "each lane gets " if streams > 1 else ""
    per_stream, why = trained, f"{each}the model's trained context ({trained} tokens)"
    if n_ctx_train is None or n_ctx_train <= 0:
        why = f"{each}{FALLBACK_CONTEXT} tokens (the model does not say its trained context)"
    if available_bytes is not None:
        budget = int(available_bytes * KV_MEMORY_SHARE / cell_bytes) // streams
        budget -= budget % CONTEXT_STEP
        if budget < per_stream:
            per_stream = max(CONTEXT_STEP, budget)
            why = (f"{each}what fits half of the {available_bytes / 2**30:.1f} GiB available"
                   f" (the model was trained for {trained})")
    cells = per_stream * streams
    size = cells * cell_bytes / 2**20
    message = (f"runtime.ctx_size = {cells} cells ({size:.0f} MiB of KV cache): {why}; "
               "set runtime.ctx_size to choose")
    return replace(config, runtime=replace(runtime, ctx_size=cells)), message


def check_layer_range(config: StageConfig, n_layer: int) -> StageConfig:
    """Check the layer range against the model and resolve an open ``layer_end``.

    Args:
        config: A validated config.
        n_layer: The model's layer count (``{arch}.block_count``).

    Returns:
        ``config`` with ``stage.layer_end`` set.

    Raises:
        ConfigError: The range does not fit the model, or does not end at the last
            layer although this is the final stage (or does although it is not).
        ValueError: ``n_layer`` is not positive.
    """
    if n_layer < 1:
        raise ValueError(f"n_layer must be at least 1 (got {n_layer})")
    stage = config.stage
    end = n_layer if stage.layer_end is None else stage.layer_end
    model = f"the model's {n_layer} layer{'s' if n_layer != 1 else ''}"
    issues: list[ConfigIssue] = []
    if stage.layer_start >= n_layer:
        issues.append(ConfigIssue(
            "stage.layer_start", f"must be less than {model} (got {stage.layer_start})"))
    if end > n_layer:
        issues.append(ConfigIssue("stage.layer_end", f"must be at most {model} (got {end})"))
    elif config.is_final and end < n_layer:
        issues.append(ConfigIssue(
            "stage.layer_end",
            f"the final stage (no [downstream]) must end at {model} (got {end})"))
    elif not config.is_final and end == n_layer:
        issues.append(ConfigIssue(
            "stage.layer_end",
            f"must be less than {model} when [downstream] is set (got {end})"))
    if issues:
        raise ConfigError(issues, "<model>")
    return replace(config, stage=replace(stage, layer_end=end))


def _read_toml(file: Path, source: str) -> dict[str, Any]:
    try:
        with file.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError.single(source, "no such config file") from None
    except IsADirectoryError:
        raise ConfigError.single(source, "is a directory, not a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError.single(source, f"invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError.single(source, f"not valid UTF-8 (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError.single(source, f"cannot read: {exc.strerror}") from None


def _resolve_paths(data: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    for section, key in _PATH_KEYS:
        table = data.get(section)
        if isinstance(table, dict) and isinstance(table.get(key), str) and table[key]:
            path = Path(table[key]).expanduser()
            table[key] = str(path if path.is_absolute() else base_dir / path)
    return data


def _override_target(name: str) -> tuple[str, str]:
    section, _, key = OVERRIDE_KEYS.get(name, name).partition(".")
    if not key or section not in SECTIONS:
        raise TypeError(
            f"unknown override {name!r}: use one of {', '.join(OVERRIDE_KEYS)}"
            " or a section.key path"
        )
    return section, key


def _section_tables(data: Mapping[str, Any], issues: IssueCollector) -> dict[str, dict]:
    tables: dict[str, dict] = {}
    for name, value in data.items():
        if name not in SECTIONS:
            issues.add(name, _unknown_top_level(name, value))
        elif not isinstance(value, dict):
            issues.add(name, f"expected a table (got {show_value(value)})")
        else:
            tables[name] = value
    return tables


def _parse_table(name: str, table: Mapping[str, Any], issues: IssueCollector) -> dict:
    specs = {spec.name: spec for spec in fields(SECTIONS[name])}
    hints = _type_hints(SECTIONS[name])
    values: dict[str, Any] = {}
    for key, value in table.items():
        spec = specs.get(key)
        if spec is None:
            issues.add(f"{name}.{key}", _unknown_key(name, key))
            continue
        try:
            values[key] = convert_value(value, hints[key], spec.metadata)
        except ValueError as exc:
            issues.add(f"{name}.{key}", str(exc))
    for spec in specs.values():
        if _is_required(spec) and spec.name not in table:
            issues.add(f"{name}.{spec.name}", f"missing (required in [{name}])")
    return values


def convert_value(value: Any, hint: Any, meta: Mapping[str, Any]) -> Any:
    """Check one TOML value against a field's type and rules.

    Args:
        value: The value as TOML gave it.
        hint: The field's resolved type (``int``, ``str | None``, a ``Literal``...).
        meta: The field's metadata (``lo``, ``hi``, ``check``).

    Returns:
        The value, normalised (floats from integers, stripped ``tcp://``...).

    Raises:
        ValueError: With a message naming the expected and the actual value.
    """
    if get_origin(hint) is Literal:
        return _convert_choice(value, get_args(hint))
    base = _strip_none(hint)
    is_bool = isinstance(value, bool)
    ok = {
        bool: is_bool,
        int: isinstance(value, int) and not is_bool,
        float: isinstance(value, int | float) and not is_bool,
        str: isinstance(value, str),
    }[base]
    if not ok:
        raise ValueError(f"expected {_TYPE_LABELS[base]} (got {show_value(value)})")
    if base is float:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number (got {value})")
    _check_range(value, meta.get("lo"), meta.get("hi"))
    check = meta.get("check")
    return value if check is None else check(value)


def _convert_choice(value: Any, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in choices:
        return value
    listed = ", ".join(json.dumps(choice) for choice in choices)
    got = show_value(value)
    if isinstance(value, str) and (close := _closest(value, choices)):
        got += f'; did you mean "{close}"?'
    raise ValueError(f"must be one of {listed} (got {got})")


def _check_range(value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and hi is not None and not lo <= value <= hi:
        raise ValueError(f"must be between {lo} and {hi} (got {value})")
    if lo is not None and value < lo:
        raise ValueError(f"must be at least {lo} (got {value})")
    if hi is not None and value > hi:
        raise ValueError(f"must be at most {hi} (got {value})")


def _strip_none(hint: Any) -> Any:
    if get_origin(hint) in (Union, types.UnionType):
        (hint,) = [arg for arg in get_args(hint) if arg is not type(None)]
    return hint


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _is_required(spec: Field) -> bool:
    has_default = spec.default is not MISSING or spec.default_factory is not MISSING
    return not has_default and not spec.metadata.get("derived", False)


def _closest(word: str, candidates: Any) -> str | None:
    by_lower = {candidate.lower(): candidate for candidate in candidates}
    match = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[match[0]] if match else None


def _suggest(text: str, suggestion: str | None) -> str:
    return f'{text} (did you mean "{suggestion}"?)' if suggestion else text


def _key_elsewhere(key: str, exclude: str | None = None) -> str | None:
    owners: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        if section != exclude:
            for spec in fields(cls):
                owners.setdefault(spec.name, section)
    match = _closest(key, owners)
    return f"{owners[match]}.{match}" if match else None


def _unknown_key(section: str, key: str) -> str:
    own = _closest(key, [spec.name for spec in fields(SECTIONS[section])])
    return _suggest("unknown key", own or _key_elsewhere(key, exclude=section))


def _unknown_top_level(name: str, value: Any) -> str:
    if isinstance(value, dict):
        return _suggest("unknown section", _closest(name, SECTIONS))
    return _suggest("unknown key", _key_elsewhere(name) or _closest(name, SECTIONS))


def _build(given: dict[str, dict], issues: IssueCollector, raw: dict) -> StageConfig:
    """Make the tree from the valid keys, filling defaults that depend on others."""
    stage_keys = given.get("stage", {})
    stage = StageSection(**{"model_id": model_id_for(stage_keys.get("model_path")),
                            **stage_keys})
    runtime_keys = given.get("runtime", {})
    threads = runtime_keys.get("threads", available_cpus())
    runtime = RuntimeSection(**{"threads": threads, "threads_batch": threads, **runtime_keys})
    http = None
    if stage.is_first:
        http = HttpSection(**given.get("http", {}))
    control = ControlSection(**{"socket": str(default_socket_path(stage.id)),
                                **given.get("control", {})})
    return StageConfig(
        stage=stage,
        runtime=runtime,
        http=http,
        sampling=SamplingSection(**given.get("sampling", {})),
        control=control,
        telemetry=TelemetrySection(**given.get("telemetry", {})),
        kv_cache=KvCacheSection(**given.get("kv_cache", {})),
        speculative=SpeculativeSection(**given.get("speculative", {})),
        link=LinkSection(**given.get("link", {})),
        upstream=_build_peer("upstream", given, stage.index - 1, issues),
        downstream=_build_peer("downstream", given, stage.index + 1, issues),
        raw=raw,
    )


def _build_peer(
    name: str, given: dict[str, dict], default_index: int, issues: IssueCollector
) -> PeerConfig | None:
    if name not in given:
        return None
    keys = given[name]
    if "stage_id" not in keys or "endpoint" not in keys:
        issues.bad.add(name)  # reported already; keeps the rules from adding more
        return None
    return PeerConfig(**{"stage_index": default_index, **keys})
