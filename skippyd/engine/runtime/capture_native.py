"""The graph-output capture of a non-final stage as a small C callback.

llama.cpp calls a context's ``cb_eval`` for *every* node of the graph (several hundred
per decode), first to ask whether the node is wanted. A Python callback pays a ctypes
transition and a GIL acquisition per node: about 2 ms per decode of a 15-layer slice
of SmolLM2 on one thread, and, whenever another Python thread of the daemon (the HTTP
loop streaming tokens, a link reader) holds the GIL, a wait of up to the interpreter's
switch interval per node; a decode of 5 ms was measured at 138 ms next to a busy
thread. The callback below does the same job without the interpreter: it compares the
node's name with the target, and copies the target's rows into a buffer the runtime
owns. It is compiled once per process with the C compiler that building
llama-cpp-python needs anyway; without one, :func:`make_layer_capture` falls back to
the Python callback.
"""

from __future__ import annotations

import ctypes
import logging
import tempfile
from pathlib import Path

import numpy as np
from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.native_build import CompiledOnce, build_shared_library

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

typedef const char *(*get_name_fn)(const void *tensor);
typedef size_t (*nbytes_fn)(const void *tensor);
typedef void (*tensor_get_fn)(const void *tensor, void *data, size_t offset, size_t size);

struct skippyd_capture {
    get_name_fn get_name;
    nbytes_fn nbytes;
    tensor_get_fn tensor_get;
    char *buffer;
    size_t capacity;
    size_t used;
    int overflow;
    char target[64];
};

bool skippyd_capture_eval(void *tensor, bool ask, void *user_data) {
    struct skippyd_capture *c = (struct skippyd_capture *)user_data;
    const char *name = c->get_name(tensor);
    if (name == NULL || strcmp(name, c->target) != 0) {
        return !ask;  /* not asked for; a computed node lets the graph go on */
    }
    if (ask) {
        return true;
    }
    size_t size = c->nbytes(tensor);
    if (c->used + size > c->capacity) {
        c->overflow = 1;
    } else {
        c->tensor_get(tensor, c->buffer + c->used, 0, size);
        c->used += size;
    }
    return false;  /* stop: the rest of the graph (norm, output head) is not needed */
}
"""


class _CaptureState(ctypes.Structure):
    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("nbytes", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("buffer", ctypes.c_void_p),
        ("capacity", ctypes.c_size_t),
        ("used", ctypes.c_size_t),
        ("overflow", ctypes.c_int),
        ("target", ctypes.c_char * 64),
    ]


def _compile() -> ctypes.CDLL:
    """Build the callback into a temporary directory and load it.

    Raises:
        OSError: No C compiler, or it failed.
    """
    with tempfile.TemporaryDirectory(prefix="skippyd-capture-") as tmp:
        library = build_shared_library(_SOURCE, Path(tmp) / "capture.so")
        # The loaded mapping outlives the file, so the directory can go.
        return ctypes.CDLL(str(library))


COMPILED = CompiledOnce(_compile, "native activation capture",
                        "using the slower Python callback", logging.WARNING)


def native_library() -> ctypes.CDLL | None:
    """The compiled callback (built on first use), or None when it cannot be built."""
    return COMPILED.get()


class NativeLayerCapture:
    """Captures ``l_out-{n_layer-1}`` rows with the compiled callback.

    Same interface as :class:`~skippyd.engine.runtime.llama_ext.LayerOutputCapture`:
    ``callback`` and ``user_data`` go into the context parameters, :meth:`begin` before
    each decode, :meth:`take` after it.

    Args:
        library: From :func:`native_library`.
        ggml: ``libggml-base`` (``ggml_get_name``, ``ggml_nbytes``,
            ``ggml_backend_tensor_get``).
        n_layer: Layers of the stage's slice.
        n_embd: Width of a row.
        max_tokens: Most tokens one decode holds (``n_batch``).
    """

    def __init__(self, library: ctypes.CDLL, ggml: ctypes.CDLL, n_layer: int, n_embd: int,
                 max_tokens: int) -> None:
        self._n_embd = n_embd
        self._buffer = np.empty(max_tokens * n_embd, dtype=np.float32)
        state = _CaptureState()
        state.get_name = ctypes.cast(ggml.ggml_get_name, ctypes.c_void_p).value
        state.nbytes = ctypes.cast(ggml.ggml_nbytes, ctypes.c_void_p).value
        state.tensor_get = ctypes.cast(ggml.ggml_backend_tensor_get, ctypes.c_void_p).value
        state.buffer = self._buffer.ctypes.data
        state.capacity = self._buffer.nbytes
        state.target = f"l_out-{n_layer - 1}".encode()
        self._state = state  # referenced for the context's lifetime (DESIGN.md item 6)
        address = ctypes.cast(library.skippyd_capture_eval, ctypes.c_void_p).value
        self.callback = L.ggml_backend_sched_eval_callback(address)
        self.user_data = ctypes.cast(ctypes.pointer(state), ctypes.c_void_p)

    def begin(self) -> None:
        self._state.used = 0
        self._state.overflow = 0

    def take(self) -> np.ndarray:
        """All rows captured since :meth:`begin`, in the order llama.cpp computed them
        (micro-batch by micro-batch), as a copy.

        Raises:
            RuntimeError: The decode produced more rows than ``max_tokens``.
        """
        if self._state.overflow:
            raise RuntimeError(f"captured rows exceed the {len(self._buffer) // self._n_embd}"
                               "-token capture buffer")
        count = self._state.used // 4
        return self._buffer[:count].reshape(-1, self._n_embd).copy()
