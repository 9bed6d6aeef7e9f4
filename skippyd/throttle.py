"""Rate-limited logging for events a remote peer can repeat at will.

A failed API key, a refused link handshake or a connection closed for being too slow
must be visible to the operator, but an attacker who repeats one a million times must
not be able to fill the journal (or spend the daemon's CPU formatting lines).
:class:`ThrottledLog` lets the first event of a kind through, then at most one line per
interval, which says how many were suppressed in between.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: Default spacing of lines of one kind, in seconds.
DEFAULT_INTERVAL_S = 10.0
#: Distinct kinds remembered at once; beyond it the oldest is forgotten (bounded memory).
MAX_KINDS = 256


class ThrottledLog:
    """Logs at most one line per ``interval_s`` per kind; counts what it suppressed.

    Thread-safe: the HTTP event loop and the link's connection threads share one.

    Args:
        target: The logger the lines go to.
        interval_s: Least spacing of two lines of one kind.
        clock: Monotonic clock (injectable for tests).
    """

    def __init__(self, target: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s: must be >= 0 (got {interval_s})")
        self._target = target
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self.total: dict[str, int] = {}
        """Events seen per kind, logged or not (for tests and counters)."""

    def log(self, level: int, kind: str, message: str, *args: object) -> bool:
        """Log ``message % args`` unless a line of ``kind`` went out recently.

        Returns:
            True if the line was written.
        """
        now = self._clock()
        with self._lock:
            self.total[kind] = self.total.get(kind, 0) + 1
            last = self._last.get(kind)
            if last is not None and now - last < self._interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return False
            suppressed = self._suppressed.pop(kind, 0)
            self._last.pop(kind, None)
            self._last[kind] = now
            if len(self._last) > MAX_KINDS:
                oldest = next(iter(self._last))
                del self._last[oldest]
                self._suppressed.pop(oldest, None)
                self.total.pop(oldest, None)
        if suppressed:
            message += " (%d more like it in the last %.0f s not logged)"
            args = (*args, suppressed, self._interval_s)
        self._target.log(level, message, *args)
        return True

    def warning(self, kind: str, message: str, *args: object) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, kind, message, *args)

    def info(self, kind: str, message: str, *args: object) -> bool:
        """:meth:`log` at INFO."""
        return self.log(logging.INFO, kind, message, *args)
