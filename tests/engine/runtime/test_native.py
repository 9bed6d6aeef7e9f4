"""The native helpers the install built: loaded once, checked against ctypes, optional.

Nothing is compiled while serving: the library is built by ``pip install`` and only
loaded here. A struct whose size differs between the library and ctypes refuses the
helpers; ``SKIPPYD_NATIVE=off`` or an install without a compiler serves on the Python
paths. The greedy pick of a step is one numpy argmax and must pick what a row-by-row
pick does.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
import sys

import pytest
from test_runtime import GREEDY, small_runtime

from skippyd.engine.runtime import native
from skippyd.engine.runtime.contract import IterationRequest, RowPhase, SamplingConfig
from skippyd.engine.runtime.llama import LlamaRuntime


@pytest.fixture
def fresh_load(monkeypatch):
    """A monkeypatch whose changes are undone, and the helpers loaded again, after the
    test: the rest of the suite expects them as the install left them."""
    yield monkeypatch
    monkeypatch.undo()
    native.reload()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler: the install builds no native helpers")
def test_the_install_built_the_helpers_and_they_load():
    assert native.library_path() is not None, "pip install built no skippyd/_native library"
    loaded = native.reload()
    assert loaded.library is not None and loaded.signal_decode is not None, loaded.missing
    assert set(native.fast_paths().values()) >= {"native"}


def test_off_serves_on_the_python_paths(fresh_load):
    fresh_load.setenv(native.NATIVE_ENV, "off")
    loaded = native.reload()
    assert loaded.library is None and loaded.signal_decode is None
    paths = native.fast_paths()
    assert paths["activation_capture"] == paths["wake_before_decode"] == (
        f"python ({native.NATIVE_ENV}=off)")
    assert "python" in native.describe_fast_paths()


def test_a_struct_of_another_size_refuses_the_helpers_with_an_error_line(fresh_load, caplog):
    if native.library_path() is None:
        pytest.skip("the install built no native helpers")

    class Wider(ctypes.Structure):
        _fields_ = [*native.L.llama_batch._fields_, ("added_field", ctypes.c_void_p)]

    fresh_load.setattr(native.L, "llama_batch", Wider)
    with caplog.at_level(logging.ERROR, logger=native.__name__):
        loaded = native.reload()
    assert loaded.library is None
    assert "llama_batch is" in (loaded.missing or "")
    assert any("native helpers refused" in r.getMessage() for r in caplog.records)


def test_serving_never_runs_a_compiler(tiny_model_path):
    # A fresh interpreter whose PATH has no compiler and whose CC fails loudly: loading
    # a runtime and decoding must not need one.
    code = (
        "import sys\n"
        "from skippyd.engine.runtime import native\n"
        "from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions\n"
        "from skippyd.engine.runtime.contract import IterationRequest\n"
        f"rt = LlamaRuntime(RuntimeOptions({str(tiny_model_path)!r}, lane_count=1,"
        " ctx_size=128, n_batch=32, n_ubatch=32, threads=1))\n"
        "out = rt.run_iteration([IterationRequest('a', [1, 2], sample_last=True)])\n"
        "rt.close()\n"
        "print(native.describe_fast_paths())\n"
    )
    env = {"PATH": "/nonexistent", "CC": "/nonexistent/cc"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    # With the helpers the install built, the fast paths are on without any compiler.
    expected = "native" if native.library_path() is not None else "python (not built"
    assert f"activation capture: {expected}" in result.stdout, result.stdout


def test_an_install_that_built_no_helpers_says_so(fresh_load, tmp_path):
    fresh_load.setattr(native, "_LIBRARY_DIR", tmp_path)  # an empty package directory
    loaded = native.reload()
    assert loaded.library is None and loaded.signal_decode is None
    assert loaded.missing == "not built: the install found no C compiler"
    assert native.fast_paths()["activation_capture"].startswith("python (not built")


def _steps(rt: LlamaRuntime, sessions: dict[str, list[int]], configs: dict, steps: int):
    """Prefill then decode ``sessions`` together, each with its own sampling config."""
    requests = [IterationRequest(s, tokens, sampling=configs[s], sample_last=True)
                for s, tokens in sessions.items()]
    seen = {s: [] for s in sessions}
    for _ in range(steps):
        out = rt.run_iteration(requests)
        for sample in out.samples:
            seen[requests[sample.request_index].session_id].append(sample.token)
        requests = [IterationRequest(s, [tokens[-1]], sampling=configs[s], sample_last=True,
                                     phase=RowPhase.DECODE)
                    for s, tokens in seen.items()]
    return seen


@pytest.mark.parametrize("mixed", [False, True], ids=["all-greedy", "mixed"])
def test_one_argmax_per_step_picks_what_row_by_row_picks(tiny_model_path, monkeypatch, mixed):
    sessions = {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7, 8, 9]}
    configs = dict.fromkeys(sessions, GREEDY)
    if mixed:  # other outputs in the buffer: a seeded draw and prompt log-probabilities
        configs["b"] = SamplingConfig(temperature=0.8, seed=3)
        configs["c"] = SamplingConfig(temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    with small_runtime(tiny_model_path, 3, 256) as rt:
        batched = _steps(rt, sessions, configs, steps=6)
    monkeypatch.setattr(LlamaRuntime, "_greedy_argmax", lambda *_args: {})
    with small_runtime(tiny_model_path, 3, 256) as rt:
        row_by_row = _steps(rt, sessions, configs, steps=6)
    assert batched == row_by_row
