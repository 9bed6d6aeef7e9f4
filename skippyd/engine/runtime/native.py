"""The native helpers ``pip install`` built (``skippyd/_native``), loaded and checked once.

Two hot spots cost the interpreter more than the work they do, so they run as C: the
activation capture of a non-final stage (:class:`NativeLayerCapture`, called for every
graph node) and the eventfd write that wakes the HTTP loop inside the same foreign call
as ``llama_decode`` (:mod:`~skippyd.engine.runtime.wake_decode`). They are optional: at
first use every struct shared with Python or llama.cpp is checked against its ctypes
declaration, and without a compiler, on a mismatch or with ``SKIPPYD_NATIVE=off`` the
Python paths serve. :func:`fast_paths` says which paths are active.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from llama_cpp import llama_cpp as L

logger = logging.getLogger(__name__)

#: Set to ``off`` to serve without the native helpers.
NATIVE_ENV = "SKIPPYD_NATIVE"
_LIBRARY_DIR = Path(__file__).resolve().parents[2] / "_native"
_LIBRARY_STEM = "helpers"


class _CaptureState(ctypes.Structure):
    """``struct skippyd_capture`` of ``capture.c``."""

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


@dataclass(frozen=True, slots=True)
class NativeHelpers:
    """The loaded helpers, or why there are none (``library`` None, ``missing`` set)."""

    library: ctypes.CDLL | None
    missing: str | None = None
    signal_decode: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
    """``int32 (decode_fn, int32 fd, ctx, llama_batch)``: write ``fd``, then decode."""


def library_path() -> Path | None:
    """The built library in the package, or None when the install built none."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _LIBRARY_DIR / f"{_LIBRARY_STEM}{suffix}"
        if path.is_file():
            return path
    return None


def _sizes_agree(library: ctypes.CDLL) -> str | None:
    """Why the library's structs differ from the ctypes declarations, or None."""
    pairs = (("llama_batch", library.skippyd_llama_batch_size, L.llama_batch),
             ("struct skippyd_capture", library.skippyd_capture_state_size, _CaptureState))
    for name, size_of, declared in pairs:
        size_of.argtypes = []
        size_of.restype = ctypes.c_size_t
        built, expected = size_of(), ctypes.sizeof(declared)
        if built != expected:
            return (f"{name} is {built} bytes in the built helpers but {expected} in "
                    f"ctypes (llama-cpp-python changed it: reinstall skippyd)")
    return None


def _load() -> NativeHelpers:
    if os.environ.get(NATIVE_ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return NativeHelpers(None, f"{NATIVE_ENV}=off")
    path = library_path()
    if path is None:
        return NativeHelpers(None, "not built: the install found no C compiler")
    try:
        library = ctypes.CDLL(str(path))
        mismatch = _sizes_agree(library)
    except (OSError, AttributeError) as exc:
        return NativeHelpers(None, f"{path.name} does not load: {exc}")
    if mismatch is not None:
        logger.error("native helpers refused: %s", mismatch)
        return NativeHelpers(None, mismatch)
    signal_decode = library.skippyd_signal_decode
    signal_decode.argtypes = [ctypes.c_void_p, ctypes.c_int32, L.llama_context_p_ctypes,
                              L.llama_batch]
    signal_decode.restype = ctypes.c_int32
    return NativeHelpers(library, signal_decode=signal_decode)


_lock = threading.Lock()
_helpers: NativeHelpers | None = None


def helpers() -> NativeHelpers:
    """The helpers of this process (loaded and checked on the first call)."""
    global _helpers
    loaded = _helpers
    if loaded is not None:  # every decode asks: no lock once loaded
        return loaded
    with _lock:
        if _helpers is None:
            _helpers = _load()
        return _helpers


def reload() -> NativeHelpers:
    """Load again (tests change ``SKIPPYD_NATIVE``)."""
    global _helpers
    with _lock:
        _helpers = None
    return helpers()


def fast_paths() -> dict[str, str]:
    """Each helper's path here: ``native``, or ``python (why)``."""
    loaded = helpers()
    how = "native" if loaded.library is not None else f"python ({loaded.missing})"
    return {"activation_capture": how, "wake_before_decode": how,
            "greedy_pick": "numpy (one argmax per step)"}


def describe_fast_paths() -> str:
    """One line for the start-up log."""
    return ", ".join(f"{name.replace('_', ' ')}: {how}" for name, how in fast_paths().items())


class NativeLayerCapture:
    """Captures ``l_out-{n_layer-1}`` rows with the built callback.

    Same interface as :class:`~skippyd.engine.runtime.llama_ext.LayerOutputCapture`:
    ``callback`` and ``user_data`` go into the context parameters, :meth:`begin` before
    each decode, :meth:`take` after it.

    Args:
        library: :attr:`NativeHelpers.library`.
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
        # Referenced for the context's lifetime: llama.cpp keeps the pointer.
        self._state = state
        address = ctypes.cast(library.skippyd_capture_eval, ctypes.c_void_p).value
        assert address is not None  # a symbol the library exports
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
