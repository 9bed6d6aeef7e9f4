"""A watch on the runtime's model calls that makes a hung llama.cpp call visible.

The worker thread cannot report on itself while it is stuck inside ``llama_decode``, so
the runtime marks each batched call on its :class:`CallWatch` (``with watch:``);
``/health`` and the systemd watchdog read :meth:`CallWatch.stalled_for` from other
threads. With a progress source (the count of graph nodes llama.cpp computed,
:mod:`skippyd.engine.runtime.progress`) a call is judged by the time since it last made
progress, not by its length: a prefill that runs for minutes on a CPU is busy, not hung.

Fault injection for tests: ``SKIPPYD_FAULT=hang-iteration`` makes every watched call
block forever (the only way to produce a hung native call on demand).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

FAULT_ENV = "SKIPPYD_FAULT"


class CallWatch:
    """When the current model call started, and whether it still makes progress.

    Args:
        progress: Returns a count that grows while llama.cpp computes (graph nodes);
            None judges a call by its length.
        fault: ``hang-iteration`` blocks every call forever (tests only); None reads
            ``SKIPPYD_FAULT``.
    """

    def __init__(self, progress: Callable[[], int] | None = None, *,
                 fault: str | None = None) -> None:
        self._started: float | None = None
        self._progress = progress
        self._seen = (-1, 0.0)  # (progress count, when it was first seen)
        self._seen_lock = threading.Lock()
        self._fault = fault if fault is not None else os.environ.get(FAULT_ENV)
        if self._fault == "hang-iteration":
            logger.warning("fault injection active: %s", self._fault)

    def __enter__(self) -> CallWatch:
        self._started = time.monotonic()
        if self._fault == "hang-iteration":
            threading.Event().wait()
        return self

    def __exit__(self, *_exc) -> None:
        self._started = None

    def busy_for(self) -> float:
        """Seconds the current call has been running (0 when idle)."""
        started = self._started
        return 0.0 if started is None else time.monotonic() - started

    def stalled_for(self) -> float:
        """Seconds the current call has gone without progress (0 when idle).

        Without a progress source, the length of the call. The count is sampled by the
        callers (the watchdog every quarter period), so progress is seen within one of
        their intervals.
        """
        started = self._started
        if started is None:
            return 0.0
        now = time.monotonic()
        if self._progress is None:
            return now - started
        count = self._progress()
        with self._seen_lock:
            if count != self._seen[0]:
                self._seen = (count, now)
            return now - max(self._seen[1], started)


def unwatched() -> CallWatch:
    """The watch of a runtime nobody watches (yet): it only timestamps, and no test
    fault applies to it."""
    return CallWatch(fault="")
