"""Tests of the TOML stage config: defaults, validation messages, overrides, dumping."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest

from skippyd.config import (
    DEFAULT_MODEL_FILE,
    FLASH_ATTN_TYPE_IDS,
    GGML_TYPE_IDS,
    MAX_LANES,
    ConfigError,
    ConfigIssue,
    apply_overrides,
    available_cpus,
    candidate_socket_paths,
    check_layer_range,
    check_pipeline,
    config_to_dict,
    config_to_toml,
    default_config,
    default_model_path,
    default_socket_path,
    example_config_toml,
    load_config,
    parse_config,
    parse_host_port,
    resolve_context,
)
from skippyd.config import defaults as config_defaults
from skippyd.config.schema import SECTIONS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
SECRET = "0123456789abcdef-test-secret"


def issues_of(data: dict[str, Any]) -> list[str]:
    """Parse ``data``, expecting a ConfigError, and return its issues as strings."""
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return [str(issue) for issue in info.value.issues]


def later_stage(**sections: dict[str, Any]) -> dict[str, Any]:
    """A valid stage-1 config (layers 15..) with ``sections`` merged in per key."""
    data: dict[str, Any] = {
        "stage": {"id": "stage-1", "index": 1, "layer_start": 15},
        "link": {"listen": "127.0.0.1:9102", "secret": SECRET},
        "upstream": {"stage_id": "stage-0", "endpoint": "tcp://127.0.0.1:9101"},
    }
    for name, table in sections.items():
        data.setdefault(name, {}).update(table)
    return data


def write(tmp_path: Path, text: str, name: str = "stage.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------- defaults


def test_default_config_values() -> None:
    config = default_config()
    assert config == parse_config({})
    assert (config.stage.id, config.stage.index, config.stage.layer_start) == ("stage-0", 0, 0)
    assert config.stage.layer_end is None and config.stage.model_path is None
    assert config.stage.model_id == DEFAULT_MODEL_FILE.removesuffix(".gguf")
    runtime = config.runtime
    assert (runtime.ctx_size, runtime.lane_count, runtime.n_batch, runtime.n_ubatch) == (
        None, 4, 2048, 512)  # the context is sized from the model once it is read
    assert runtime.kv_layout == "per_lane" and runtime.session_tokens is None
    assert runtime.threads == available_cpus() == runtime.threads_batch
    assert (runtime.cache_type_k, runtime.cache_type_v, runtime.flash_attn) == (
        "f16", "f16", "auto")
    assert runtime.continuous_batching and not runtime.safe_mode
    assert runtime.queue_capacity == 64
    assert config.http is not None
    assert config.http.listen == "127.0.0.1:8080" and config.http.address == ("127.0.0.1", 8080)
    assert config.http.max_prompt_tokens == runtime.ctx_size
    assert config.http.max_body_bytes == 1 << 20 and config.http.drain_timeout_s == 30.0
    assert config.kv_cache.mode == "auto" and config.kv_cache.host_ram_bytes == 256 << 20
    assert config.link.max_frame_bytes == 64 << 20 and config.link.secret is None
    assert config.telemetry.log_level_number == logging.INFO
    assert config.is_first and config.is_final
    assert config.control.socket_path == default_socket_path("stage-0")


def test_derived_defaults_follow_other_keys() -> None:
    config = parse_config({
        "stage": {"id": "alpha", "model_path": "models/Tiny-Llama.Q8_0.gguf"},
        "runtime": {"ctx_size": 1024, "threads": 3},
    })
    assert config.stage.model_id == "Tiny-Llama.Q8_0"
    assert config.runtime.threads_batch == 3
    assert config.http is not None and config.http.max_prompt_tokens is None
    assert config.runtime.session_tokens == 1024 // 4  # a lane's share: the prompt limit
    assert config.control.socket_path.name == "alpha.sock"
    assert config.resolved_model_path == Path("models/Tiny-Llama.Q8_0.gguf")


def test_explicit_values_beat_derived_defaults() -> None:
    config = parse_config({
        "stage": {"model_id": "served-name", "model_path": "m.gguf"},
        "runtime": {"threads": 3, "threads_batch": 5},
        "http": {"max_prompt_tokens": 100, "model_alias": "alias"},
        "control": {"socket": "/run/x/control.sock"},
    })
    assert config.stage.model_id == "served-name" and config.served_model_id == "alias"
    assert (config.runtime.threads, config.runtime.threads_batch) == (3, 5)
    assert config.http is not None and config.http.max_prompt_tokens == 100
    assert config.control.socket == "/run/x/control.sock"


def test_later_stage_has_no_http_and_peers_resolve() -> None:
    config = parse_config(later_stage(link={"listen": "[::1]:9102"}))
    assert config.http is None and not config.is_first and config.is_final
    assert config.upstream is not None
    assert config.upstream.endpoint == "127.0.0.1:9101"  # tcp:// stripped
    assert config.upstream.stage_index == 0  # defaults to index - 1
    assert config.upstream.address == ("127.0.0.1", 9101)
    assert config.link.listen_address == ("::1", 9102)


def test_config_is_frozen() -> None:
    config = default_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.runtime.lane_count = 9  # type: ignore[misc]


def test_socket_path_resolution_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    system = tmp_path / "run-skippyd"
    monkeypatch.setattr(config_defaults, "SYSTEM_RUNTIME_DIR", system)
    temp_sock = Path(tempfile.gettempdir()) / f"skippyd-{os.getuid()}" / "s.sock"
    both = {"XDG_RUNTIME_DIR": "/run/user/7", "RUNTIME_DIRECTORY": "/run/skippyd:/run/b"}
    assert candidate_socket_paths("s", both) == [
        Path("/run/user/7/skippyd/s.sock"), Path("/run/skippyd/s.sock"), temp_sock,
        system / "s.sock"]
    # A template instance's own runtime directory (RuntimeDirectory=skippyd/%i).
    (system / "stage1").mkdir(parents=True)
    (system / "stage1" / "s.sock").touch()
    assert candidate_socket_paths("s", {})[-2:] == [system / "s.sock", system / "stage1" / "s.sock"]
    assert default_socket_path("s", {"RUNTIME_DIRECTORY": "/run/skippyd"}) == Path(
        "/run/skippyd/s.sock")
    assert default_socket_path("s", {}) == temp_sock
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/42")
    config = parse_config({"stage": {"id": "beta"}})
    assert config.control.socket_path == Path("/run/user/42/skippyd/beta.sock")


def test_llama_cpp_lookup_tables_match_the_libraries() -> None:
    gguf = pytest.importorskip("gguf")
    for name, type_id in GGML_TYPE_IDS.items():
        assert gguf.GGMLQuantizationType[name.upper()].value == type_id
    llama = pytest.importorskip("llama_cpp.llama_cpp")
    for name, value in FLASH_ATTN_TYPE_IDS.items():
        assert getattr(llama, f"LLAMA_FLASH_ATTN_TYPE_{name.upper()}") == value
    config = parse_config({"runtime": {"cache_type_k": "q8_0", "flash_attn": "enabled"}})
    assert config.runtime.ggml_type_k == gguf.GGMLQuantizationType.Q8_0.value
    assert config.runtime.flash_attn_type == llama.LLAMA_FLASH_ATTN_TYPE_ENABLED


# ---------------------------------------------------------------- per-key errors


@pytest.mark.parametrize(("data", "expected"), [
    ({"runtime": {"lane_count": "four"}}, 'runtime.lane_count: expected an integer (got "four")'),
    ({"runtime": {"lane_count": True}}, "runtime.lane_count: expected an integer (got true)"),
    ({"runtime": {"ctx_size": 2.5}}, "runtime.ctx_size: expected an integer (got 2.5)"),
    ({"runtime": {"ctx_size": {}}}, "runtime.ctx_size: expected an integer (got a table)"),
    ({"runtime": {"safe_mode": 1}}, "runtime.safe_mode: expected a boolean (got 1)"),
    ({"http": {"drain_timeout_s": "30"}},
     'http.drain_timeout_s: expected a number (got "30")'),
    ({"http": {"drain_timeout_s": float("inf")}},
     "http.drain_timeout_s: expected a finite number (got inf)"),
    ({"stage": {"model_path": [1]}}, "stage.model_path: expected a string (got an array)"),
    ({"telemetry": 3}, "telemetry: expected a table (got 3)"),
])
def test_type_errors_name_expected_and_actual(data: dict, expected: str) -> None:
    assert issues_of(data) == [expected]


@pytest.mark.parametrize(("data", "expected"), [
    ({"runtime": {"lane_count": 0}},
     f"runtime.lane_count: must be between 1 and {MAX_LANES} (got 0)"),
    ({"runtime": {"lane_count": MAX_LANES + 1}},
     f"runtime.lane_count: must be between 1 and {MAX_LANES} (got {MAX_LANES + 1})"),
    ({"stage": {"index": -1}}, "stage.index: must be at least 0 (got -1)"),
    ({"http": {"max_logit_bias": 300}}, "http.max_logit_bias: must be between 0 and 256 (got 300)"),
    ({"http": {"drain_timeout_s": -1}},
     "http.drain_timeout_s: must be between 0.0 and 3600.0 (got -1.0)"),
    ({"kv_cache": {"min_tokens": 0}}, "kv_cache.min_tokens: must be at least 1 (got 0)"),
    ({"runtime": {"target_decode_steps": -1}},
     "runtime.target_decode_steps: must be between 0.0 and 1000.0 (got -1.0)"),
])
def test_range_errors_give_the_range(data: dict, expected: str) -> None:
    assert issues_of(data) == [expected]


@pytest.mark.parametrize(("data", "expected"), [
    ({"runtime": {"flash_attn": "enable"}},
     'runtime.flash_attn: must be one of "auto", "enabled", "disabled" '
     '(got "enable"; did you mean "enabled"?)'),
    ({"telemetry": {"level": 2}}, 'telemetry.level: must be one of "summary", "debug" (got 2)'),
    ({"kv_cache": {"mode": "lookup_record"}},
     'kv_cache.mode: must be one of "disabled", "auto", "record", "lookup-record" '
     '(got "lookup_record"; did you mean "lookup-record"?)'),
])
def test_choice_errors_list_the_choices(data: dict, expected: str) -> None:
    assert issues_of(data) == [expected]


@pytest.mark.parametrize(("data", "expected"), [
    ({"http": {"listen": "8080"}}, 'http.listen: expected host:port (got "8080")'),
    ({"http": {"listen": "h:70000"}}, "http.listen: port must be at most 65535 (got 70000)"),
    ({"http": {"listen": "::1:80"}},
     'http.listen: expected host:port, IPv6 hosts in brackets (got "::1:80")'),
    ({"stage": {"id": "a/b"}},
     'stage.id: must be 1-64 letters, digits, ".", "_" or "-", starting with a letter or '
     'digit (got "a/b")'),
    ({"http": {"api_key": ""}}, "http.api_key: must not be empty (leave the key out instead)"),
    ({"runtime": {"tensor_split": "3;1"}},
     'runtime.tensor_split: expected comma-separated numbers such as "3,1" (got \'3;1\')'),
    ({"runtime": {"tensor_split": "0,0"}},
     "runtime.tensor_split: at least one share must be above 0 (got '0,0')"),
    ({"runtime": {"tensor_split": "1,-1"}},
     "runtime.tensor_split: every share must be a finite number >= 0 (got '1,-1')"),
    ({"runtime": {"tensor_split": ",".join(["1"] * 17)}},
     "runtime.tensor_split: at most 16 devices (got 17)"),
    ({"runtime": {"gpu_layers": -2}},
     "runtime.gpu_layers: must be between -1 and 1048576 (got -2)"),
    ({"runtime": {"main_gpu": 16}}, "runtime.main_gpu: must be between 0 and 15 (got 16)"),
])
def test_format_errors(data: dict, expected: str) -> None:
    assert issues_of(data) == [expected]


def test_gpu_offload_keys_default_to_the_cpu_and_normalise_the_split() -> None:
    default = parse_config({})
    assert (default.runtime.gpu_layers, default.runtime.main_gpu) == (0, 0)
    assert default.runtime.tensor_split is None
    chosen = parse_config({"runtime": {"gpu_layers": -1, "main_gpu": 1,
                                       "tensor_split": " 3, 1.0 "}})
    assert (chosen.runtime.gpu_layers, chosen.runtime.main_gpu) == (-1, 1)
    assert chosen.runtime.tensor_split == "3,1"


def test_short_secret_is_rejected_without_echoing_it() -> None:
    issues = issues_of(later_stage(link={"secret": "hunter2"}))
    assert issues == ["link.secret: must be at least 16 characters (got 7)"]
    assert "hunter2" not in "".join(issues)


def test_peer_endpoint_scheme_and_required_keys() -> None:
    issues = issues_of(later_stage(upstream={"endpoint": "http://h:1"}))
    assert issues == ['upstream.endpoint: unsupported scheme "http" '
                      "(expected host:port or tcp://host:port)"]
    data = later_stage()
    del data["upstream"]["endpoint"]
    assert issues_of(data) == ["upstream.endpoint: missing (required in [upstream])"]


# ---------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(("data", "expected"), [
    ({"runtime": {"lane_cout": 3}}, 'runtime.lane_cout: unknown key (did you mean "lane_count"?)'),
    ({"runtime": {"Lane_Count": 3}},
     'runtime.Lane_Count: unknown key (did you mean "lane_count"?)'),
    ({"runtime": {"listen": "h:1"}}, 'runtime.listen: unknown key (did you mean "http.listen"?)'),
    ({"runtime": {"zzzz": 1}}, "runtime.zzzz: unknown key"),
    ({"kvcache": {"mode": "auto"}}, 'kvcache: unknown section (did you mean "kv_cache"?)'),
    ({"metrics": {}}, "metrics: unknown section"),
    ({"ctx_size": 4096}, 'ctx_size: unknown key (did you mean "runtime.ctx_size"?)'),
])
def test_unknown_keys_and_sections_suggest(data: dict, expected: str) -> None:
    assert issues_of(data) == [expected]


# ---------------------------------------------------------------- cross-field rules


@pytest.mark.parametrize(("data", "expected"), [
    (later_stage(stage={"layer_start": 12, "layer_end": 10}),
     "stage.layer_end: must be greater than layer_start (got 10 <= 12)"),
    ({"stage": {"layer_start": 5}}, "stage.layer_start: must be 0 when stage.index is 0 (got 5)"),
    (later_stage(stage={"layer_start": 0}),
     "stage.layer_start: must be greater than 0 when stage.index is 1 "
     "(only stage 0 starts at layer 0)"),
    ({"runtime": {"n_batch": 256, "n_ubatch": 512}},
     "runtime.n_ubatch: must be at most n_batch (got 512 > 256)"),
    ({"runtime": {"cache_type_v": "q4_0", "flash_attn": "disabled"}},
     'runtime.cache_type_v: a quantized V cache needs flash attention '
     '(got "q4_0" with flash_attn = "disabled")'),
    ({"runtime": {"ctx_size": 1024, "kv_layout": "unified"},
      "http": {"max_prompt_tokens": 2048}},
     "http.max_prompt_tokens: must be at most what one request may hold (got 2048 > 1024)"),
    ({"runtime": {"ctx_size": 4096, "kv_layout": "per_lane"},
      "http": {"max_prompt_tokens": 2048}},
     "http.max_prompt_tokens: must be at most what one request may hold (got 2048 > 1024)"),
    ({"http": {"default_max_tokens": 5000}},
     "http.default_max_tokens: must be at most max_tokens_limit (got 5000 > 4096)"),
    (later_stage(http={"listen": "127.0.0.1:8080"}),
     "http: only the first stage serves HTTP (stage.index 1, layer_start 15); remove [http]"),
    (later_stage(upstream={"stage_index": 5}),
     "upstream.stage_index: must be stage.index - 1 = 0 (got 5)"),
    (later_stage(upstream={"stage_id": "stage-1"}),
     'upstream.stage_id: must differ from stage.id (both "stage-1")'),
    ({"stage": {"layer_end": 15}, "link": {"secret": SECRET},
      "downstream": {"stage_id": "s1", "stage_index": 2, "endpoint": "h:9"}},
     "downstream.stage_index: must be stage.index + 1 = 1 (got 2)"),
    ({"link": {"secret": SECRET}, "downstream": {"stage_id": "s1", "endpoint": "h:9"}},
     "stage.layer_end: required when [downstream] is set "
     "(the next stage owns the layers after it)"),
    ({"stage": {"layer_end": 15}, "downstream": {"stage_id": "s1", "endpoint": "h:9"}},
     "link.secret: required when [upstream] or [downstream] is set"),
    ({"upstream": {"stage_id": "s9", "endpoint": "h:9"}, "link": {"secret": SECRET}},
     "upstream: not allowed on the first stage (stage.index 0, layer_start 0)"),
    ({"link": {"listen": "0.0.0.0:8080"}},
     "link.listen: must use another port than http.listen (both use 8080)"),
    ({"control": {"socket": "/" + "s" * 120}},
     "control.socket: must be at most 107 bytes for a Unix socket (got 121); "
     "set a shorter path"),
])
def test_cross_field_rules(data: dict, expected: str) -> None:
    assert issues_of(data) == [expected]


def test_later_stage_needs_upstream_and_link_listen() -> None:
    data = later_stage()
    del data["upstream"]
    del data["link"]["listen"]
    assert issues_of(data) == [
        "upstream: required on a stage after the first (stage.index 1, layer_start 15)",
        "link.listen: required on a stage after the first (the upstream stage connects to it)",
    ]


def test_all_errors_are_collected_and_listed_one_per_line() -> None:
    data = {
        "stage": {"layer_end": 0},
        "runtime": {"lane_count": "four", "lane_cout": 3, "n_batch": 64, "n_ubatch": 128},
        "kvcache": {},
        "http": {"listen": "nowhere"},
    }
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="bad.toml")
    error = info.value
    assert error.source == "bad.toml"
    assert error.keys == ["kvcache", "stage.layer_end", "runtime.lane_count",
                          "runtime.lane_cout", "http.listen", "runtime.n_ubatch"]
    assert str(error).splitlines() == [str(issue) for issue in error.issues]
    assert all(isinstance(issue, ConfigIssue) for issue in error.issues)


def test_a_bad_key_does_not_cause_follow_up_rule_errors() -> None:
    # n_batch is bad, so the n_ubatch <= n_batch rule must stay quiet.
    assert issues_of({"runtime": {"n_batch": "big", "n_ubatch": 4096}}) == [
        'runtime.n_batch: expected an integer (got "big")']


# ---------------------------------------------------------------- files


def test_toml_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, '[runtime]\nctx_size = 4096\nlane_count == 4\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (issue,) = info.value.issues
    assert issue.key == str(path)
    assert issue.message.startswith("invalid TOML:") and "line 3, column" in issue.message


def test_missing_file_directory_and_bad_encoding(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(info.value) == f"{missing}: no such config file"
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    binary = tmp_path / "latin1.toml"
    binary.write_bytes(b'[stage]\nid = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="not valid UTF-8"):
        load_config(binary)


def test_relative_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[stage]\nmodel_path = "models/m.gguf"\n'
                 '[runtime]\nslice_cache_dir = "~/slices"\n')
    config = load_config(path)
    assert config.stage.model_path == str(tmp_path / "models" / "m.gguf")
    assert config.runtime.slice_cache_dir == str(Path.home() / "slices")
    assert config.stage.model_id == "m"


# ---------------------------------------------------------------- layer range


def test_check_layer_range_resolves_open_end() -> None:
    config = check_layer_range(default_config(), 30)
    assert config.stage.layer_end == 30 and config.stage.num_layers == 30
    later = check_layer_range(parse_config(later_stage()), 30)
    assert (later.stage.layer_start, later.stage.layer_end) == (15, 30)


@pytest.mark.parametrize(("data", "expected"), [
    ({"stage": {"layer_end": 31}},
     "stage.layer_end: must be at most the model's 30 layers (got 31)"),
    ({"stage": {"layer_end": 20}},
     "stage.layer_end: the final stage (no [downstream]) must end at the model's 30 layers "
     "(got 20)"),
    ({"stage": {"layer_end": 30}, "link": {"secret": SECRET},
      "downstream": {"stage_id": "s1", "endpoint": "h:9"}},
     "stage.layer_end: must be less than the model's 30 layers when [downstream] is set "
     "(got 30)"),
    (later_stage(stage={"layer_start": 30}),
     "stage.layer_start: must be less than the model's 30 layers (got 30)"),
])
def test_check_layer_range_errors(data: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_layer_range(parse_config(data), 30)
    assert [str(issue) for issue in info.value.issues] == [expected]


def test_check_layer_range_rejects_empty_model() -> None:
    with pytest.raises(ValueError, match="n_layer"):
        check_layer_range(default_config(), 0)


# ---------------------------------------------------------------- overrides


def test_overrides_apply_and_rederive_defaults() -> None:
    base = parse_config({"runtime": {"n_batch": 1024}})
    config = apply_overrides(base, listen="0.0.0.0:9000", ctx_size=2048, lane_count=8,
                             threads=2, log_level="debug", api_key=None,
                             model_path=Path("m/x.gguf"), layer_end=20, layer_start=None)
    assert config.http is not None
    assert config.http.listen == "0.0.0.0:9000" and config.http.api_key is None
    assert config.runtime.ctx_size == 2048 and config.http.max_prompt_tokens is None
    assert config.runtime.session_tokens == 2048 // 8  # a lane's share: the prompt limit
    assert (config.runtime.lane_count, config.runtime.threads_batch) == (8, 2)
    assert config.runtime.n_batch == 1024  # kept from the file
    assert config.telemetry.log_level == "debug"
    assert config.stage.model_path == "m/x.gguf" and config.stage.model_id == "x"
    assert config.stage.layer_end == 20
    assert base.runtime.lane_count == 4  # the original is unchanged


def test_overrides_accept_key_paths_and_revalidate() -> None:
    config = apply_overrides(default_config(), **{"kv_cache.mode": "disabled"})
    assert not config.kv_cache.enabled
    with pytest.raises(ConfigError) as info:
        apply_overrides(default_config(), lane_count=0, listen="bad")
    assert info.value.keys == ["runtime.lane_count", "http.listen"]
    with pytest.raises(ConfigError) as info:
        apply_overrides(parse_config(later_stage()), listen="127.0.0.1:8080")
    assert info.value.keys == ["http"]
    with pytest.raises(TypeError, match="unknown override"):
        apply_overrides(default_config(), nonsense=1)


# ---------------------------------------------------------------- dumping and examples


def full_config_data() -> dict[str, Any]:
    return later_stage(
        stage={"model_path": "/models/big.gguf", "layer_end": 20},
        runtime={"ctx_size": 8192, "lane_count": 16, "cache_type_v": "q8_0",
                 "flash_attn": "enabled", "slice_cache_dir": "/var/cache/skippyd"},
        control={"group": "skippyd"},
        telemetry={"level": "debug", "log_level": "warning"},
        kv_cache={"mode": "lookup-record", "payload": "full-state", "max_entries": 9},
        link={"connect_timeout_s": 5},
        downstream={"stage_id": "stage-2", "endpoint": "10.0.0.3:9103"},
    )


@pytest.mark.parametrize("config_factory", [
    default_config,
    lambda: parse_config(full_config_data()),
    lambda: apply_overrides(default_config(), api_key="k", **{"http.model_alias": "m"}),
])
def test_round_trip_through_toml(tmp_path: Path, config_factory: Any) -> None:
    config = config_factory()
    as_dict = config_to_dict(config)
    json.dumps(as_dict)  # JSON-serialisable
    assert all(value is not None for table in as_dict.values() for value in table.values())
    path = write(tmp_path, config_to_toml(config))
    again = load_config(path)
    assert again == config
    assert config_to_toml(again) == config_to_toml(config)


def test_dump_omits_absent_sections_and_floats_stay_floats() -> None:
    config = parse_config(full_config_data())
    tables = config_to_dict(config)
    assert "http" not in tables and tables["upstream"]["endpoint"] == "127.0.0.1:9101"
    assert tables["link"]["connect_timeout_s"] == 5.0
    assert isinstance(config.link.connect_timeout_s, float)


def test_example_config_loads_as_defaults_and_mentions_every_key() -> None:
    text = example_config_toml()
    assert parse_config(tomllib.loads(text)) == default_config()
    for name, cls in SECTIONS.items():
        assert f"[{name}]" in text
        for spec in dataclasses.fields(cls):
            assert f"\n{spec.name} = " in text or f"\n# {spec.name} = " in text, spec.name


def test_all_examples_load() -> None:
    paths = sorted(EXAMPLES.rglob("*.toml"))
    assert len(paths) == 6
    for path in paths:
        check_layer_range(load_config(path), 30)


def test_single_example() -> None:
    config = load_config(EXAMPLES / "single.toml")
    assert config.stage.model_path is None and config.is_first and config.is_final
    assert (config.runtime.lane_count, config.runtime.ctx_size) == (8, None)


@pytest.mark.parametrize(("directory", "ranges"), [
    ("split-2", [(0, 17), (17, 30)]),
    ("split-3", [(0, 11), (11, 22), (22, 30)]),
])
def test_split_examples_chain(directory: str, ranges: list[tuple[int, int]],
                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="skippyd.config"):
        configs = [load_config(path) for path in sorted((EXAMPLES / directory).glob("*.toml"))]
    assert "example value" in caplog.text  # the "change me" secret is flagged
    check_pipeline(configs)
    resolved = [check_layer_range(config, 30) for config in configs]
    assert [(c.stage.layer_start, c.stage.layer_end) for c in resolved] == ranges
    assert [c.is_first for c in configs] == [True] + [False] * (len(configs) - 1)
    assert [c.is_final for c in configs] == [False] * (len(configs) - 1) + [True]
    assert configs[0].http is not None and all(c.http is None for c in configs[1:])


def test_check_pipeline_reports_mismatches() -> None:
    configs = [load_config(path) for path in sorted((EXAMPLES / "split-2").glob("*.toml"))]
    broken = apply_overrides(configs[1], layer_start=14,
                             **{"link.secret": "another-secret-of-16+", "link.listen": "h:1"})
    with pytest.raises(ConfigError) as info:
        check_pipeline([configs[0], broken])
    assert info.value.keys == ["stages[1].stage.layer_start", "stages[1].link.secret",
                               "stages[0].downstream.endpoint"]
    with pytest.raises(ConfigError) as info:
        check_pipeline(configs[1:])
    assert info.value.keys == ["stages[0].stage.index"]


# ---------------------------------------------------------------- helpers


def test_parse_host_port() -> None:
    assert parse_host_port("localhost:0") == ("localhost", 0)
    assert parse_host_port("[::1]:8080") == ("::1", 8080)
    for bad in ("", ":80", "host", "host:", "host:８０", "[]:80"):
        with pytest.raises(ValueError):
            parse_host_port(bad)


def test_default_model_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec(config_defaults.MODEL_PACKAGE) is not None:
        path = default_model_path()
        assert path.name == DEFAULT_MODEL_FILE and path.is_file()
        assert default_config().resolved_model_path == path
    monkeypatch.setattr(config_defaults, "MODEL_PACKAGE", "skippyd_no_such_model_package")
    with pytest.raises(ConfigError) as info:
        _ = default_config().resolved_model_path
    assert info.value.keys == ["stage.model_path"]
    assert "pip install 'skippyd[model]'" in str(info.value)


def test_check_pipeline_needs_no_listening_stage_0_but_equal_capacity() -> None:
    configs = [load_config(path) for path in sorted((EXAMPLES / "split-2").glob("*.toml"))]
    head = dataclasses.replace(configs[0], link=dataclasses.replace(configs[0].link,
                                                                     listen=None))
    check_pipeline([head, configs[1]])  # nothing dials stage 0: its [upstream] is a label
    small = dataclasses.replace(configs[1], runtime=dataclasses.replace(
        configs[1].runtime, lane_count=2, ctx_size=1024))
    with pytest.raises(ConfigError) as info:
        check_pipeline([configs[0], small])
    assert info.value.keys == ["stages[1].runtime.lane_count", "stages[1].runtime.ctx_size"]
    assert "must be at least stages[0].runtime.lane_count = 4 (got 2)" in str(info.value)
    unified = dataclasses.replace(configs[1], runtime=dataclasses.replace(
        configs[1].runtime, lane_count=16, kv_layout="unified"))
    check_pipeline([configs[0], unified])  # in one pool every session may use all of it
    crowded = dataclasses.replace(configs[1], runtime=dataclasses.replace(
        configs[1].runtime, lane_count=16, kv_layout="per_lane"))
    head = dataclasses.replace(configs[0], runtime=dataclasses.replace(
        configs[0].runtime, kv_layout="per_lane"))
    with pytest.raises(ConfigError) as info:
        check_pipeline([head, crowded])
    assert info.value.keys == ["stages[1].runtime.ctx_size"]
    assert "2048 tokens per session (per_lane layout, ctx_size 32768, 16 lanes) must be at " \
        "least stage 0's 8192" in str(info.value)


def test_link_advertise_and_activation_dtype() -> None:
    final = parse_config(later_stage(link={"advertise": "tcp://203.0.113.7:9102"}))
    assert final.link.advertise == "203.0.113.7:9102"
    assert final.link.activation_dtype == "f32"
    middle = later_stage(stage={"layer_end": 20}, link={"advertise": "10.0.0.2:9102"},
                         downstream={"stage_id": "stage-2", "endpoint": "127.0.0.1:9103"})
    assert issues_of(middle) == [
        "link.advertise: only the final stage announces a return endpoint (stage 0 dials "
        "it for predictions)"]
    assert issues_of(later_stage(link={"activation_dtype": "f8"}))[0].startswith(
        "link.activation_dtype")


# -- the API's defaults ------------------------------------------------------------------

def test_sampling_defaults_are_llama_servers_and_configurable() -> None:
    sampling = default_config().sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p) == (
        0.8, 40, 0.95, 0.05)
    changed = parse_config({"sampling": {"temperature": 0.2, "top_k": 0}}, "<test>").sampling
    assert (changed.temperature, changed.top_k) == (0.2, 0)
    with pytest.raises(ConfigError, match=r"sampling\.top_p: must be"):
        parse_config({"sampling": {"top_p": 1.5}}, "<test>")


def test_no_default_max_tokens_means_the_context(tmp_path: Path) -> None:
    assert default_config().http.default_max_tokens is None
    assert parse_config({"http": {"default_max_tokens": 64}}, "<t>").http.default_max_tokens == 64


def test_a_chat_template_file_is_checked(tmp_path: Path) -> None:
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (tmp_path / "stage.toml").write_text('[http]\nchat_template_file = "good.jinja"\n')
    assert load_config(tmp_path / "stage.toml").http.chat_template_file == str(good)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match=r"http\.chat_template_file: .*bad\.jinja is not a "
                                          r"valid Jinja template"):
        parse_config({"http": {"chat_template_file": str(bad)}}, "<t>")
    with pytest.raises(ConfigError, match=r"http\.chat_template_file: cannot read"):
        parse_config({"http": {"chat_template_file": str(tmp_path / "missing.jinja")}}, "<t>")


def test_telemetry_keys_for_logs_and_the_metrics_listener() -> None:
    telemetry = parse_config({"telemetry": {
        "log_format": "json", "log_requests": False, "stats_interval_s": 0,
        "metrics_listen": "0.0.0.0:9190"}}).telemetry
    assert telemetry.log_format == "json" and not telemetry.log_requests
    assert telemetry.stats_interval_s == 0.0 and telemetry.metrics_address == ("0.0.0.0", 9190)
    defaults = parse_config({}).telemetry
    assert (defaults.log_format, defaults.log_requests, defaults.stats_interval_s,
            defaults.metrics_listen) == ("auto", True, 10.0, None)
    with pytest.raises(ConfigError) as info:
        parse_config({"telemetry": {"log_format": "jsno", "metrics_listen": "127.0.0.1:8080"}})
    assert info.value.keys == ["telemetry.log_format", "telemetry.metrics_listen"]
    assert 'did you mean "json"' in str(info.value)
    assert "another port than http.listen (both use 8080)" in str(info.value)


@pytest.mark.parametrize(("layout", "available", "cells", "why"), [
    # Each of the 4 lanes gets the whole trained context; one pool gets it once.
    ("per_lane", None, 4 * 8192, "each lane gets the model's trained context (8192 tokens)"),
    ("unified", None, 8192, "the model's trained context (8192 tokens)"),
    # 1 GiB available, half for KV, 1 KiB a token: 512 Ki cells, 128 Ki a lane.
    ("per_lane", 1 << 30, 4 * 8192, "each lane gets the model's trained context"),
    # 64 MiB: 32 Ki cells in all, 8 Ki a lane: exactly the trained context.
    ("per_lane", 64 << 20, 4 * 8192, "each lane gets the model's trained context"),
    # 32 MiB: 16 Ki cells, 4 Ki a lane.
    ("per_lane", 32 << 20, 4 * 4096, "each lane gets what fits half of the 0.0 GiB"),
    ("unified", 8 << 20, 4096, "what fits half of the 0.0 GiB available"),
])
def test_an_open_context_gives_every_request_the_trained_context_within_memory(
        layout, available, cells, why):
    config = parse_config({"runtime": {"kv_layout": layout}})
    # 512 K and V values a token at f16: 1 KiB a cell.
    sized, message = resolve_context(config, n_ctx_train=8192, kv_values_per_token=512,
                                     available_bytes=available)
    assert sized.runtime.ctx_size == cells and why in message
    assert sized.runtime.session_tokens == (cells // 4 if layout == "per_lane" else cells)
    fixed = parse_config({"runtime": {"ctx_size": 2048, "kv_layout": layout}})
    assert resolve_context(fixed, n_ctx_train=8192, kv_values_per_token=512,
                           available_bytes=available) == (fixed, None)
