"""Prometheus histograms and counters for the per-token path of the event loop.

``prometheus_client``'s own ``Histogram.observe`` takes two locks and walks the bucket
list in Python, and ``Counter.inc`` takes one, on every token, on the event loop thread
while llama.cpp's threads compute. When the cores are few, that thread's time comes out
of the decode twice over (one compute thread is preempted and the other waits for it at
the next barrier), so per-token bookkeeping has to be cheap (``docs/performance-notes.md``
has the figures).

The classes here keep plain numbers that only the event loop thread updates (a bisect
and two additions per observation) and are registered in a ``CollectorRegistry`` like
any collector: Prometheus sees the same ``_bucket`` / ``_count`` / ``_sum`` /
``_created`` and ``_total`` / ``_created`` series that ``prometheus_client``'s classes
expose. A scrape reads them on another thread without a lock; it may see an observation
in ``_count`` a moment before its ``_sum``, never a count that goes down.
"""

from __future__ import annotations

import itertools
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_INF = float("inf")


class LoopHistogram(Collector):
    """A label-less Prometheus histogram updated from one thread.

    Args:
        name: Metric name (``_bucket``, ``_count``, ``_sum``, ``_created`` are appended).
        documentation: Help text.
        buckets: Upper bounds, increasing; ``+Inf`` is added when missing.

    Raises:
        ValueError: The bounds are empty or not strictly increasing.
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        bounds = [float(b) for b in buckets]
        if not bounds or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"{name}: bucket bounds must be non-empty and increasing")
        if bounds[-1] != _INF:
            bounds.append(_INF)
        self.name = name
        self.documentation = documentation
        self._bounds = tuple(bounds)
        self._labels = tuple(floatToGoString(b) for b in bounds)
        self._counts = [0] * len(bounds)
        self._sum = 0.0
        self._created = time.time()

    def observe(self, value: float) -> None:
        """Count one observation (event loop thread)."""
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    @property
    def count(self) -> int:
        """Observations so far."""
        return sum(self._counts)

    def describe(self) -> list[Any]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[Any]:
        counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for label, count in zip(self._labels, counts, strict=True):
            cumulative += count
            buckets.append((label, cumulative))
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], buckets, total)
        family.samples.append(Sample(self.name + "_created", {}, self._created))
        yield family


class LoopCounter(Collector):
    """A label-less Prometheus counter updated from one thread.

    Args:
        name: Metric name without ``_total``.
        documentation: Help text.
    """

    def __init__(self, name: str, documentation: str) -> None:
        self.name = name
        self.documentation = documentation
        self.value = 0.0
        self._created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (event loop thread).

        Raises:
            ValueError: ``amount`` is negative (a counter only goes up).
        """
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (got {amount})")
        self.value += amount

    def describe(self) -> list[Any]:
        return [CounterMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[Any]:
        yield CounterMetricFamily(self.name, self.documentation, value=self.value,
                                  created=self._created)
