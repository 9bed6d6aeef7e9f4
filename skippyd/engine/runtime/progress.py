"""A count of the graph nodes llama.cpp has computed, kept without entering Python.

A long prefill is one ``llama_decode`` call that may run for minutes on a CPU; judging
"hung" by the length of the call would kill it. llama.cpp calls a context's abort
callback on its compute thread after every graph node, so the callback is the place to
count progress: but a Python callback there would take the GIL hundreds of times per
micro-batch. The callback installed here is libc's ``sem_post`` on a private, unnamed
semaphore: each call is one atomic increment in C, and returns 0 ("do not abort") when
it succeeds. Other threads read the count with ``sem_getvalue``; the worker resets it
before every call, so it never nears ``SEM_VALUE_MAX`` (where ``sem_post`` would fail
and its -1 would read as "abort").

Where unnamed semaphores are missing (macOS), :func:`make_compute_progress` returns None
and callers judge a call by its length only.
"""

from __future__ import annotations

import ctypes
import logging

from llama_cpp import llama_cpp as L

logger = logging.getLogger(__name__)

# NOTE: sizeof(sem_t) is 32 on glibc and musl (x86-64, aarch64); 64 bytes of 8-byte
# aligned storage leave room for any libc we may meet.
_SEM_WORDS = 8


class ComputeProgress:
    """A node counter that llama.cpp bumps as it computes (see the module docstring).

    Keep the object alive for as long as the context it is installed on.
    """

    def __init__(self, libc: ctypes.CDLL) -> None:
        self._libc = libc
        self._sem = (ctypes.c_uint64 * _SEM_WORDS)()
        self._value = ctypes.c_int(0)
        if libc.sem_init(self._sem, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        address = ctypes.cast(libc.sem_post, ctypes.c_void_p).value
        assert address is not None  # a libc function
        self.callback = L.ggml_abort_callback(address)

    def install(self, ctx: L.llama_context_p) -> None:
        """Make llama.cpp count every computed node of ``ctx``'s graphs here."""
        L.llama_set_abort_callback(ctx, self.callback, ctypes.cast(self._sem, ctypes.c_void_p))

    def reset(self) -> None:
        """Back to 0. Only while no decode runs on the context (the worker, between calls)."""
        self._libc.sem_init(self._sem, 0, 0)

    def count(self) -> int:
        """Nodes computed since the last reset; safe on any thread."""
        self._libc.sem_getvalue(self._sem, ctypes.byref(self._value))
        return self._value.value


def make_compute_progress() -> ComputeProgress | None:
    """A :class:`ComputeProgress`, or None where this libc has no unnamed semaphores."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
        libc.sem_getvalue.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        return ComputeProgress(libc)
    except (OSError, AttributeError) as exc:
        logger.info("no compute progress counter (%s): a runtime call is judged by its length",
                    exc)
        return None
