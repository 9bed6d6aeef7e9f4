"""The compiled greedy pick equals numpy's argmax, masked tokens read as -inf."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skippyd.engine.runtime import greedy_native

GET_LOGITS = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)


@pytest.fixture(scope="module")
def native():
    if greedy_native.native_greedy() is None:
        pytest.skip("no C compiler on this machine")


def _numpy_pick(row: np.ndarray, masked: list[int]) -> int:
    token = int(row.argmax())
    if token in masked:
        row = row.copy()
        row[masked] = -np.inf
        token = int(row.argmax())
    return token


def _pick(rows: np.ndarray, masked: list[int]):
    """A compiled pick reading ``rows`` (one per batch row) through a C callback."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)

    @GET_LOGITS
    def get_logits(_ctx, row):
        return None if row >= len(rows) else rows[row].ctypes.data

    pick = greedy_native.greedy_picker(rows.shape[1], masked,
                                       get_logits=ctypes.cast(get_logits, ctypes.c_void_p).value)
    assert pick is not None
    return pick, (get_logits, rows)  # the callback and rows must outlive the calls


logit = st.floats(min_value=-50, max_value=50, width=32) | st.sampled_from(
    [0.0, 1.0, float("inf"), float("-inf"), float("nan")])


@given(st.lists(logit, min_size=1, max_size=40), st.lists(st.integers(0, 39), max_size=3))
def test_the_pick_is_numpys_argmax_with_masked_tokens_at_minus_inf(native, values, masked):
    row = np.array(values, dtype=np.float32)
    masked = sorted({m for m in masked if m < len(row)})
    pick, _alive = _pick(row[None, :], masked)
    assert pick(0, 0) == _numpy_pick(row, masked)


def test_ties_go_to_the_first_and_a_masked_winner_gives_way(native):
    rows = np.array([[0.0, 3.0, 1.0, 3.0, 2.0], [0.0, 1.0, 9.0, 1.0, 9.0]], dtype=np.float32)
    pick, _alive = _pick(rows, [2])
    assert pick(0, 0) == 1
    assert pick(0, 1) == 4  # row 1's first highest is masked: the next highest wins


def test_a_row_without_logits_is_an_error(native):
    pick, _alive = _pick(np.zeros((1, 4), dtype=np.float32), [])
    with pytest.raises(ValueError, match="no logits"):
        pick(0, 5)


def test_without_a_compiler_there_is_no_native_pick(monkeypatch, request):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    greedy_native.COMPILED.forget()
    request.addfinalizer(greedy_native.COMPILED.forget)
    assert greedy_native.greedy_picker(8) is None
    assert "cc" in (greedy_native.COMPILED.unavailable or "")
