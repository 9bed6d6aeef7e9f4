"""The native activation capture equals the Python one, bit for bit, and falls back.

A non-final stage's rows come from a ``cb_eval`` callback; the native one must capture
exactly what the Python one does (same rows, several micro-batches appended), and an
install without the native helpers must still serve with the Python callback.
"""

from __future__ import annotations

import numpy as np
import pytest

from skippyd.engine.runtime import llama_ext, native
from skippyd.engine.runtime.contract import IterationRequest
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.model_files.slice import cached_slice


def _rows(model_path, monkeypatch, *, native: bool,
          expect: str | None = None) -> list[np.ndarray]:
    real = llama_ext.make_layer_capture
    monkeypatch.setattr("skippyd.engine.runtime.llama.make_layer_capture",
                        lambda *a, **k: real(*a, native=native))
    options = RuntimeOptions(str(model_path), lane_count=2, ctx_size=256, n_batch=64,
                             n_ubatch=16, threads=1, final_stage=False)
    with LlamaRuntime(options) as runtime:
        kind = type(runtime._capture).__name__
        assert kind == expect or (expect is None and kind == (
            "NativeLayerCapture" if native else "LayerOutputCapture"))
        # 40 tokens: three micro-batches of 16, appended in order.
        first = runtime.run_iteration([IterationRequest("a", list(range(1, 41)))])
        second = runtime.run_iteration([IterationRequest("a", [7]),
                                                  IterationRequest("b", [3, 4, 5])])
    return [first.output_rows[0], *second.output_rows]


@pytest.fixture
def stage_slice(tiny_model_path, tmp_path):
    return cached_slice(tiny_model_path, 0, 2, tmp_path)


def test_native_capture_equals_python_capture(stage_slice, monkeypatch):
    if native.helpers().library is None:
        pytest.skip("the install built no native helpers")
    built = _rows(stage_slice, monkeypatch, native=True)
    python = _rows(stage_slice, monkeypatch, native=False)
    assert [r.shape for r in built] == [(40, 64), (1, 64), (3, 64)]
    for a, b in zip(built, python, strict=True):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b)


def test_without_the_native_helpers_the_python_callback_serves(stage_slice, monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "off")
    try:
        assert native.reload().library is None
        rows = _rows(stage_slice, monkeypatch, native=True, expect="LayerOutputCapture")
    finally:
        monkeypatch.delenv(native.NATIVE_ENV)
        native.reload()
    assert rows[0].shape == (40, 64)
