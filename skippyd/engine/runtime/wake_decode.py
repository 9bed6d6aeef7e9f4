"""A model call that first wakes another thread, in one native call.

The worker wakes the HTTP event loop right before each ``llama_decode`` (its wait hooks),
so the loop handles the last step's tokens while llama.cpp computes. Waking it from
Python means writing its eventfd while holding the GIL: the woken thread takes the CPU,
finds the GIL held, sleeps again on it, and is woken a second time when the worker
releases the GIL for the decode, and the worker pays for that back-and-forth between
two model calls. :func:`decode_signalling` writes the eventfd
from C, inside the same foreign call as ``llama_decode``: ctypes has released the GIL by
then, so the loop thread finds it free.

The helper is C built by ``pip install`` (:mod:`~skippyd.engine.runtime.native`).
Without it, the eventfd is written from Python before the call.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable, Sequence

from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.native import helpers

logger = logging.getLogger(__name__)

_DECODE_ADDRESS = ctypes.cast(L.llama_decode, ctypes.c_void_p).value


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

    The first is signalled in the same foreign call as the decode when the native helper
    is there, so the thread it wakes finds the GIL free (the others, rare, from Python
    before it). If the call raises before reaching C, that one is signalled from Python:
    an extra wake-up is harmless, a lost one is not.
    """
    function = helpers().signal_decode
    if function is None or not fds:
        signal_eventfds(fds)
        return L.llama_decode(ctx, batch)
    signal_eventfds(fds[1:])
    try:
        return function(_DECODE_ADDRESS, fds[0], ctx, batch)
    except BaseException:
        signal_eventfds(fds[:1])
        raise
