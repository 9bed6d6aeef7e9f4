"""bench/decode_calls.py: the hooks log every model call, and the accounting adds them up.

llama-server is not built on CI, so its shim is only compiled and inspected here; the
skippyd side runs for real against a daemon on the tiny model.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench_script import loaded

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "decode_calls.py"


@pytest.fixture(scope="module")
def decode_calls():
    with loaded("decode_calls") as module:
        yield module


def test_accounting_splits_a_run_into_steps_inside_and_outside(decode_calls) -> None:
    Call = decode_calls.Call
    calls = [
        Call(0.5, 9.0, 1, 1, 0, 0),       # before the run: not counted
        Call(10.0, 0.2, 60, 1, 0, 0),     # a prompt
        Call(10.3, 0.04, 2, 2, 0, 1),     # both streams decode
        Call(10.35, 0.05, 2, 2, 0, 1),
        Call(10.4, 0.04, 2, 2, 0, 1),
        Call(10.45, 0.01, 1, 1, 1, 1),    # one stream left
    ]
    figures = decode_calls.account(calls, 10.0, 11.0, streams=2)
    assert figures["step_ms"] == pytest.approx(40.0)
    assert figures["calls"] == 5
    assert figures["span_steps"] == pytest.approx(25.0)
    assert figures["inside_steps"] == pytest.approx(0.34 / 0.04)
    assert figures["inside_steps"] + figures["outside_steps"] == pytest.approx(25.0)
    assert (figures["full_calls"], figures["prompt_calls"], figures["partial_calls"]) == (3, 1, 1)
    assert figures["prompt_tokens"] == 60
    assert figures["prompt_steps"] == pytest.approx(5.0)
    assert figures["partial_steps"] == pytest.approx(0.25)


def test_a_run_without_a_full_decode_step_is_refused(decode_calls) -> None:
    calls = [decode_calls.Call(1.0, 0.2, 60, 1, 0, 0)]
    with pytest.raises(ValueError, match="no full decode step"):
        decode_calls.account(calls, 0.0, 2.0, streams=1)


def test_a_trace_line_cut_short_is_skipped(decode_calls, tmp_path) -> None:
    trace = tmp_path / "x.trace"
    trace.write_text("1.000000 0.040000 8 8 0 7\n2.000000 0.04")
    assert decode_calls.read_trace(trace) == [decode_calls.Call(1.0, 0.04, 8, 8, 0, 7)]


def test_the_llama_server_shim_wraps_the_model_calls(decode_calls, tmp_path) -> None:
    try:
        library = decode_calls.build_shim(tmp_path)
    except OSError as exc:
        pytest.skip(f"no C compiler: {exc}")
    shim = ctypes.CDLL(str(library))  # RTLD_LOCAL: nothing here resolves to it
    for name in ("llama_process", "llama_decode", "llama_batch_ext_clear",
                 "llama_batch_ext_add_token", "llama_batch_ext_set_output_logits"):
        assert hasattr(shim, name), name


def test_skippyds_calls_are_logged_and_accounted(tmp_path, tiny_model_path) -> None:
    report = tmp_path / "calls.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--workload", "stream1", "--rounds", "1",
         "--requests", "2", "--model", str(tiny_model_path), "--json", str(report)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    runs = json.loads(report.read_text())["skippyd"]
    assert len(runs) == 2  # A-B-B-A with one side: two counted runs
    for figures in runs:
        assert figures["errors"] == 0
        # Each request's prompt call samples its first token; 63 decode steps follow.
        # The warm-up request before the run, a prompt call of its own, is not counted.
        assert figures["prompt_calls"] == 2
        assert figures["full_calls"] >= 2 * 63
        assert figures["partial_calls"] == 0
        assert 0 < figures["inside_steps"] < figures["span_steps"]
    assert "full decode step, ms" in result.stdout
