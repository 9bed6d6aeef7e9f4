"""A model call that first wakes another thread, in one native call.

The worker wakes the HTTP event loop right before each ``llama_decode`` (its wait hooks),
so the loop handles the last step's tokens while llama.cpp computes. Waking it from
Python means writing its eventfd while holding the GIL: the woken thread takes the CPU,
finds the GIL held, sleeps again on it, and is woken a second time when the worker
releases the GIL for the decode. On 2 cores that back-and-forth cost the worker about
50 µs per step, between two model calls. :func:`decode_signalling` writes the eventfd
from C, inside the same foreign call as ``llama_decode``: ctypes has released the GIL by
then, so the loop thread finds it free.

The helper is compiled once per process with the system C compiler (see
:mod:`~skippyd.engine.runtime.native_build`). Without one, the eventfd is written from
Python before the call, as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.native_build import CompiledOnce, build_shared_library

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <unistd.h>

typedef struct { int32_t n_tokens; void *token; void *embd; void *pos; void *n_seq_id;
                 void *seq_id; void *logits; } llama_batch;
typedef int32_t (*decode_fn)(void *ctx, llama_batch batch);

int32_t skippyd_signal_decode(decode_fn decode, int32_t fd, void *ctx, llama_batch batch) {
    uint64_t one = 1;
    ssize_t written = write(fd, &one, sizeof one);
    (void)written;  /* a full or closed eventfd only loses a wake-up the reader no longer needs */
    return decode(ctx, batch);
}
"""


def _compile() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    with tempfile.TemporaryDirectory(prefix="skippyd-wake-") as tmp:
        library = ctypes.CDLL(str(build_shared_library(_SOURCE, Path(tmp) / "wake.so")))
    function = library.skippyd_signal_decode
    function.argtypes = [ctypes.c_void_p, ctypes.c_int32, L.llama_context_p_ctypes,
                         L.llama_batch]
    function.restype = ctypes.c_int32
    return function


_DECODE_ADDRESS = ctypes.cast(L._lib.llama_decode, ctypes.c_void_p).value
COMPILED = CompiledOnce(_compile, "native wake before decode", "waking from Python")


def signal_eventfds(descriptors: Iterable[int]) -> None:
    """Add 1 to each eventfd in ``descriptors`` (from Python; releases the GIL)."""
    for fd in descriptors:
        try:
            os.eventfd_write(fd, 1)
        except OSError as exc:  # closed by its owner: nobody waits on it any more
            logger.debug("eventfd %d not signalled: %s", fd, exc)


def decode_signalling(fds: Sequence[int], ctx: L.llama_context_p,
                      batch: L.llama_batch) -> int:
    """``llama_decode(ctx, batch)``, after adding 1 to each eventfd in ``fds``.

    The first is signalled in the same foreign call as the decode when the helper could
    be compiled, so the thread it wakes finds the GIL free (the others, rare, from Python
    before it). If the call raises before reaching C, that one is signalled from Python:
    an extra wake-up is harmless, a lost one is not.
    """
    function = COMPILED.get()
    if function is None or not fds:
        signal_eventfds(fds)
        return L.llama_decode(ctx, batch)
    signal_eventfds(fds[1:])
    try:
        return function(_DECODE_ADDRESS, fds[0], ctx, batch)
    except BaseException:
        signal_eventfds(fds[:1])
        raise
