"""Rolling windows of timestamped samples: the recent view behind rates and percentiles."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: Samples one window keeps at most (older ones are dropped first).
MAX_WINDOW_SAMPLES = 20_000


def drop_before(samples: deque, horizon: float) -> None:
    """Drop samples (timestamp first) older than ``horizon`` from the left of ``samples``."""
    while samples and samples[0][0] < horizon:
        samples.popleft()


class Window:
    """Timestamped samples of the last ``window_s`` seconds (thread-safe).

    Each sample is also passed to ``sink`` (a Prometheus histogram or counter), which
    keeps the all-time view. Expired samples are dropped as new ones arrive, so memory
    follows the recent rate, not how long the daemon has run without being read.
    """

    def __init__(self, window_s: float, clock: Callable[[], float],
                 sink: Callable[[float], None]) -> None:
        self._window_s = window_s
        self._clock = clock
        self._sink = sink
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_WINDOW_SAMPLES)
        self._lock = threading.Lock()

    def add(self, value: float, now: float | None = None) -> None:
        """Record ``value`` at ``now`` (the window's clock when None)."""
        if now is None:
            now = self._clock()
        with self._lock:
            self._samples.append((now, value))
            drop_before(self._samples, now - self._window_s)
        self._sink(value)

    def values(self) -> list[float]:
        """Values still inside the window, oldest first (older ones are pruned)."""
        horizon = self._clock() - self._window_s
        with self._lock:
            drop_before(self._samples, horizon)
            return [value for _, value in self._samples]

    def percentiles_ms(self) -> dict[str, Any]:
        """``{"p50", "p95", "p99"}`` in ms (None when empty) and ``count``."""
        values = self.values()
        if not values:
            return {"p50": None, "p95": None, "p99": None, "count": 0}
        p50, p95, p99 = (float(v) * 1000.0 for v in np.percentile(values, [50, 95, 99]))
        return {"p50": p50, "p95": p95, "p99": p99, "count": len(values)}
