"""Callbacks the worker thread runs whenever it is about to wait.

The worker waits in two ways: inside a model call (llama.cpp computes, the GIL is free)
and on its command queue. An event consumer that batches its wake-ups (the HTTP event
loop's relay) registers a hook here and wakes its own thread from it, so that thread
runs while llama.cpp computes instead of taking the GIL in the middle of the worker's
Python between two model calls (``docs/scheduler.md``, "Wait hooks").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class WaitHooks:
    """A set of hooks, added and removed from any thread, run on the worker thread."""

    def __init__(self) -> None:
        self._hooks: tuple[Callable[[], None], ...] = ()
        self._lock = threading.Lock()

    def add(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` before every wait of the worker from now on.

        ``hook`` runs on the worker thread: it must be quick and must never block.
        """
        with self._lock:
            self._hooks = (*self._hooks, hook)

    def remove(self, hook: Callable[[], None]) -> None:
        """Stop running ``hook``. Idempotent."""
        with self._lock:
            self._hooks = tuple(h for h in self._hooks if h is not hook)

    def run(self) -> None:
        """Run every hook; one that raises is logged and the others still run."""
        for hook in self._hooks:  # NOTE: an immutable tuple, read without the lock
            try:
                hook()
            except Exception:  # a consumer's bug must not stop the worker
                logger.exception("worker wait hook failed")
