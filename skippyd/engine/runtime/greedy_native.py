"""The greedy pick of one batch row as one call into C.

A greedy token is the first highest logit of its row (``numpy.argmax``; llama.cpp's
greedy sampler picks the same one), skipping the end-of-generation tokens when the
request ignores them. In Python that pick is five ctypes and numpy calls around the
argmax (the row's pointer, its address, an array type over it, a buffer view, a
read-only flag). It runs once per sampled token right after ``llama_decode``, when every
cache is cold and each call costs tens of microseconds: on a 2-core machine about 130 µs
per row, while the worker's other threads (llama.cpp's) wait for the next decode.

:func:`greedy_picker` compiles the loop below once per process with the C compiler that
building llama-cpp-python needs anyway, and hands it ``llama_get_logits_ith`` as a
function pointer, so a pick is one foreign call. Without a compiler, or on a CPU
without SSE2 (where numpy's vectorized argmax is quicker), it returns None and callers
keep the numpy path (:meth:`skippyd.engine.runtime.sampling.SamplerChain.sample`),
which picks the same tokens.
"""

from __future__ import annotations

import ctypes
import logging
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.native_build import CompiledOnce, build_shared_library

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef float *(*get_logits_fn)(void *ctx, int32_t row);

static int is_masked(int32_t token, const int32_t *masked, int32_t n_masked) {
    for (int32_t k = 0; k < n_masked; k++) {
        if (masked[k] == token) {
            return 1;
        }
    }
    return 0;
}

/* numpy.argmax with the masked tokens read as -inf: the first highest value, and a NaN
   counts as the highest (numpy returns the first NaN). */
static int32_t scalar_pick(const float *logits, int32_t n, const int32_t *masked,
                           int32_t n_masked) {
    const float lowest = -__builtin_inff();
    int32_t best = 0;
    float top = is_masked(0, masked, n_masked) ? lowest : logits[0];
    for (int32_t i = 1; i < n && top == top; i++) {
        float v = is_masked(i, masked, n_masked) ? lowest : logits[i];
        if (v > top || v != v) {
            top = v;
            best = i;
        }
    }
    return best;
}

/* The same pick without masks, eight floats at a time with SSE2 (every x86-64 has it):
   the highest value and whether a NaN occurs in one pass, then its first index. */
static int32_t fast_pick(const float *logits, int32_t n) {
#if defined(__SSE2__)
    int32_t n_vec = n / 8 * 8;
    if (n_vec >= 8) {
        __m128 top_a = _mm_loadu_ps(logits), top_b = _mm_loadu_ps(logits + 4);
        __m128 nan = _mm_or_ps(_mm_cmpunord_ps(top_a, top_a), _mm_cmpunord_ps(top_b, top_b));
        for (int32_t i = 8; i < n_vec; i += 8) {
            __m128 a = _mm_loadu_ps(logits + i), b = _mm_loadu_ps(logits + i + 4);
            nan = _mm_or_ps(nan, _mm_or_ps(_mm_cmpunord_ps(a, a), _mm_cmpunord_ps(b, b)));
            top_a = _mm_max_ps(top_a, a);
            top_b = _mm_max_ps(top_b, b);
        }
        if (_mm_movemask_ps(nan) == 0) {
            float lanes[8];
            _mm_storeu_ps(lanes, top_a);
            _mm_storeu_ps(lanes + 4, top_b);
            float top = lanes[0];
            for (int k = 1; k < 8; k++) {
                top = lanes[k] > top ? lanes[k] : top;
            }
            for (int32_t i = n_vec; i < n; i++) {
                if (logits[i] != logits[i]) {
                    return scalar_pick(logits, n, 0, 0);
                }
                top = logits[i] > top ? logits[i] : top;
            }
            __m128 want = _mm_set1_ps(top);
            for (int32_t i = 0; i < n_vec; i += 4) {
                int hit = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(logits + i), want));
                if (hit) {
                    return i + __builtin_ctz(hit);
                }
            }
            for (int32_t i = n_vec; i < n; i++) {
                if (logits[i] == top) {
                    return i;
                }
            }
        }
    }
#endif
    return scalar_pick(logits, n, 0, 0);
}

/* 1 when fast_pick has its vector loop here (elsewhere numpy's argmax is quicker). */
int32_t skippyd_greedy_vectorized(void) {
#if defined(__SSE2__)
    return 1;
#else
    return 0;
#endif
}

/* -1: the row has no logits. */
int32_t skippyd_greedy(get_logits_fn get_logits, void *ctx, int32_t row, int32_t n_vocab,
                       const int32_t *masked, int32_t n_masked) {
    const float *logits = get_logits(ctx, row);
    if (logits == 0 || n_vocab <= 0) {
        return -1;
    }
    int32_t best = fast_pick(logits, n_vocab);
    if (n_masked > 0 && is_masked(best, masked, n_masked)) {
        return scalar_pick(logits, n_vocab, masked, n_masked);
    }
    return best;
}
"""

GreedyPick = Callable[[int, int], int]
"""``pick(ctx, row)``: the greedy token of batch row ``row``.

Raises ValueError when the row has no logits."""


def _compile() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    with tempfile.TemporaryDirectory(prefix="skippyd-greedy-") as tmp:
        library = ctypes.CDLL(str(build_shared_library(_SOURCE, Path(tmp) / "greedy.so")))
    if not library.skippyd_greedy_vectorized():
        raise OSError("no SSE2 on this architecture: numpy's argmax is quicker")
    function = library.skippyd_greedy
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                         ctypes.c_void_p, ctypes.c_int32]
    function.restype = ctypes.c_int32
    return function


COMPILED = CompiledOnce(_compile, "native greedy pick", "picking with numpy")


def native_greedy() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The compiled pick (built on first use, so a runtime calls it while it loads), or
    None when it cannot be built."""
    return COMPILED.get()


def greedy_picker(n_vocab: int, masked: Sequence[int] = (), *,
                  get_logits: int | None = None) -> GreedyPick | None:
    """A greedy pick over ``n_vocab`` logits that never returns a ``masked`` token
    (unless every other logit is -inf); None without a C compiler or without SSE2.

    Args:
        n_vocab: Logits per row.
        masked: Token ids never to pick (``ignore_eos``: the end-of-generation tokens).
        get_logits: Address of a C function ``float *(void *ctx, int32_t row)``;
            llama.cpp's ``llama_get_logits_ith`` by default.
    """
    function = native_greedy()
    if function is None:
        return None
    if get_logits is None:
        get_logits = ctypes.cast(L._lib.llama_get_logits_ith, ctypes.c_void_p).value
    masked_ids = (ctypes.c_int32 * max(1, len(masked)))(*masked)
    n_masked = len(masked)

    def pick(ctx: int, row: int) -> int:
        token = function(get_logits, ctx, row, n_vocab, masked_ids, n_masked)
        if token < 0:
            raise ValueError(f"batch row {row} has no logits")
        return token

    return pick
