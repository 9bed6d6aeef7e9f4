"""The few llama.cpp pieces llama-cpp-python does not wrap: graph output capture, logging.

Every ctypes callback handed to llama.cpp is kept referenced by its owner for as long as
llama.cpp may call it: a collected callback crashes the process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.native import NativeLayerCapture, helpers

logger = logging.getLogger(__name__)

_backend_lock = threading.Lock()
_backend_ready = False
_log_callback = None  # module-level: llama.cpp keeps calling it for the process lifetime


def _ggml_base() -> ctypes.CDLL:
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        path = os.path.join(lib_dir, name)
        if os.path.exists(path):
            lib = ctypes.CDLL(path)
            lib.ggml_get_name.argtypes = [ctypes.c_void_p]
            lib.ggml_get_name.restype = ctypes.c_char_p
            lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
            lib.ggml_nbytes.restype = ctypes.c_size_t
            lib.ggml_backend_tensor_get.argtypes = [
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t
            ]
            lib.ggml_backend_tensor_get.restype = None
            return lib
    raise OSError(f"libggml-base not found next to llama_cpp in {lib_dir}")


def ensure_backend() -> None:
    """Initialise llama.cpp once per process and route its logs to Python logging."""
    global _backend_ready, _log_callback
    with _backend_lock:
        if _backend_ready:
            return
        L.llama_backend_init()

        @L.llama_log_callback
        def _on_log(level, text, _user_data):
            # NOTE: llama.cpp logs a lot at load; keep it at debug so the daemon's own
            # one-line-per-event log stays readable.
            if text and logger.isEnabledFor(logging.DEBUG):
                logger.debug("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

        _log_callback = _on_log
        L.llama_log_set(_log_callback, ctypes.c_void_p(0))
        _backend_ready = True


class LayerOutputCapture:
    """Copies the last layer's output rows out of the graph, then stops the graph.

    Installed as ``cb_eval`` on a non-final stage's context: it asks only for the tensor
    named ``l_out-{n_layer-1}``, copies it (f32, token-major, ``n_embd`` per row) and
    returns False so llama.cpp skips the output head (the next stage computes it). A prompt longer
    than ``n_ubatch`` runs the graph once per micro-batch: the captures are appended.
    """

    def __init__(self, n_layer: int, n_embd: int) -> None:
        self._ggml = _ggml_base()
        self._target = f"l_out-{n_layer - 1}".encode()
        self._n_embd = n_embd
        self._chunks: list[np.ndarray] = []
        self.callback = L.ggml_backend_sched_eval_callback(self._on_eval)
        self.user_data = None

    def _on_eval(self, tensor, ask, _user_data) -> bool:
        name = self._ggml.ggml_get_name(tensor)
        if ask:
            return name == self._target
        if name != self._target:
            return True
        nbytes = self._ggml.ggml_nbytes(tensor)
        rows = np.empty(nbytes // 4, dtype=np.float32)
        self._ggml.ggml_backend_tensor_get(tensor, rows.ctypes.data, 0, nbytes)
        self._chunks.append(rows.reshape(-1, self._n_embd))
        return False  # stop here: the rest of the graph (norm, output head) is not needed

    def begin(self) -> None:
        self._chunks.clear()

    def take(self) -> np.ndarray:
        """All rows captured since :meth:`begin`, in the order llama.cpp computed them
        (micro-batch by micro-batch; see :func:`stream_split_order`)."""
        if not self._chunks:
            return np.empty((0, self._n_embd), dtype=np.float32)
        rows = self._chunks[0] if len(self._chunks) == 1 else np.concatenate(self._chunks)
        self._chunks.clear()
        return rows


def make_layer_capture(n_layer: int, n_embd: int, max_tokens: int, *,
                       native: bool = True) -> LayerOutputCapture | NativeLayerCapture:
    """The capture of a non-final stage: the native callback when the install built it
    (:mod:`~skippyd.engine.runtime.native`: no interpreter per graph node), else the
    Python one."""
    library = helpers().library if native else None
    if library is None:
        return LayerOutputCapture(n_layer, n_embd)
    return NativeLayerCapture(library, _ggml_base(), n_layer, n_embd, max_tokens)


def stream_split_order(row_seq_ids: list[int], n_ubatch: int) -> list[int]:
    """Batch rows in the order llama.cpp computes them with one KV stream per sequence.

    With several KV streams llama.cpp cuts a batch into micro-batches that each take the
    same number of tokens from a run of consecutive sequence ids (``split_equal`` with
    ``sequential``), so a non-final stage's captured rows come out micro-batch by
    micro-batch, not in batch order. This replays that cut for a batch whose rows are
    sorted by sequence id (each sequence's rows together, one sequence per row).

    Returns:
        For each captured row, in capture order, the batch row it belongs to.
    """
    rows_of: dict[int, list[int]] = {}
    for row, seq_id in enumerate(row_seq_ids):
        rows_of.setdefault(seq_id, []).append(row)
    taken = dict.fromkeys(rows_of, 0)
    order: list[int] = []
    while len(order) < len(row_seq_ids):
        pending = [seq for seq in rows_of if taken[seq] < len(rows_of[seq])]
        run = [pending[0]]
        for seq in pending[1:]:
            if seq != run[-1] + 1 or len(run) > n_ubatch:
                break
            run.append(seq)
        fewest = min(len(rows_of[seq]) - taken[seq] for seq in run)
        count = min(fewest, max(1, n_ubatch // len(run)))
        for seq in run:
            order.extend(rows_of[seq][taken[seq]:taken[seq] + count])
            taken[seq] += count
    return order
