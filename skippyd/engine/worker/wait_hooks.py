"""Callbacks the worker thread runs whenever it is about to wait.

The worker waits in two ways: inside a model call (llama.cpp computes, the GIL is free)
and on its command queue. An event consumer that batches its wake-ups (the HTTP event
loop's relay) registers a hook here and wakes its own thread from it, so that thread
runs while llama.cpp computes instead of taking the GIL in the middle of the worker's
Python between two model calls (``docs/scheduler.md``, "Wait hooks").

A hook may instead return an eventfd for the worker to signal: before a model call the
runtime signals it from native code once the GIL is released
(:mod:`~skippyd.engine.runtime.wake_decode`), so the woken thread finds the GIL free.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from skippyd.engine.runtime.wake_decode import signal_eventfds

WaitHook = Callable[[], int | None]
"""Runs on the worker thread before it waits; returns None, or an eventfd to signal."""

logger = logging.getLogger(__name__)


class WaitHooks:
    """A set of hooks, added and removed from any thread, run on the worker thread."""

    def __init__(self) -> None:
        self._hooks: tuple[WaitHook, ...] = ()
        self._lock = threading.Lock()

    def add(self, hook: WaitHook) -> None:
        """Run ``hook`` before every wait of the worker from now on.

        ``hook`` runs on the worker thread: it must be quick and must never block. It
        returns None, or an eventfd the worker signals as the wait starts.
        """
        with self._lock:
            self._hooks = (*self._hooks, hook)

    def remove(self, hook: WaitHook) -> None:
        """Stop running ``hook``. Idempotent."""
        with self._lock:
            self._hooks = tuple(h for h in self._hooks if h is not hook)

    def run(self) -> tuple[int, ...]:
        """Run every hook and return the eventfds they ask to have signalled, which the
        caller must signal; a hook that raises is logged and the others still run."""
        descriptors: tuple[int, ...] = ()
        for hook in self._hooks:  # NOTE: an immutable tuple, read without the lock
            try:
                fd = hook()
            except Exception:  # a consumer's bug must not stop the worker
                logger.exception("worker wait hook failed")
            else:
                if type(fd) is int:
                    descriptors += (fd,)
                elif fd is not None:
                    logger.error("worker wait hook %r returned %r, not an eventfd", hook, fd)
        return descriptors

    def run_and_signal(self) -> None:
        """Run every hook and signal the eventfds they return (before a wait that is not
        a model call)."""
        descriptors = self.run()
        if descriptors:
            signal_eventfds(descriptors)
