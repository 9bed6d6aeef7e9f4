"""The periodic throughput line: what a busy stage did in the last few seconds.

Every ``telemetry.stats_interval_s`` seconds a busy stage logs what happened since the
last line: on a stage with the HTTP API, prompt and generation tokens per second,
running and waiting requests, KV use and the prefix cache's token hit rate; on a later
stage of a split pipeline, batches per second, link traffic and its busy share. An idle
stage stays quiet (one last line covers the interval in which it went idle).
Everything is read from counters that exist anyway: nothing is added to the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MIB = float(1 << 20)


@dataclass(frozen=True, slots=True)
class Reading:
    """Cumulative counters at one instant."""

    at: float
    prompt_tokens: int = 0
    generated_tokens: int = 0
    queried_tokens: int = 0
    matched_tokens: int = 0
    batches: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    busy_s: float = 0.0


class ThroughputLog:
    """Turns two readings of a stage's counters into one line.

    Args:
        metrics: The stage's :class:`~skippyd.http.observability.metrics.ServingMetrics`.
        serves_http: Whether the stage runs requests itself (stage 0).
        clock: Monotonic clock, injectable for tests.
    """

    def __init__(self, metrics: Any, *, serves_http: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._serves_http = serves_http
        self._clock = clock
        self._last = self.read()

    def read(self) -> Reading:
        m = self._metrics
        prefix = m.prefix_cache()
        link = m.link_status() or {}
        return Reading(at=self._clock(), prompt_tokens=m.num_prompt_tokens,
                       generated_tokens=m.num_generated_tokens,
                       queried_tokens=int(prefix.get("queried_tokens", 0)),
                       matched_tokens=int(prefix.get("matched_tokens", 0)),
                       batches=int(link.get("batches", 0)),
                       bytes_in=int(link.get("bytes_in", 0)),
                       bytes_out=int(link.get("bytes_out", 0)),
                       busy_s=float(link.get("busy_s", 0.0) or 0.0))

    def tick(self) -> str | None:
        """The line for the interval since the last tick, or None when it was idle."""
        now, last = self.read(), self._last
        self._last = now
        stats = self._metrics.stats()
        running = getattr(stats, "num_active", 0)
        waiting = getattr(stats, "num_waiting", 0)
        sessions = getattr(stats, "active_runtime_sessions", 0)
        moved = (now.prompt_tokens, now.generated_tokens, now.batches) != \
            (last.prompt_tokens, last.generated_tokens, last.batches)
        if not (moved or running or waiting):
            return None
        span = max(now.at - last.at, 1e-9)
        if not self._serves_http:
            return (f"throughput: {(now.batches - last.batches) / span:.1f} batches/s,"
                    f" link in {(now.bytes_in - last.bytes_in) / span / MIB:.2f} MiB/s,"
                    f" out {(now.bytes_out - last.bytes_out) / span / MIB:.2f} MiB/s,"
                    f" busy {min(1.0, (now.busy_s - last.busy_s) / span):.0%},"
                    f" sessions {sessions}")
        used, total = self._metrics.kv_cells()
        queried = now.queried_tokens - last.queried_tokens
        hit = f"{(now.matched_tokens - last.matched_tokens) / queried:.1%}" if queried else "-"
        return (f"throughput: prompt {(now.prompt_tokens - last.prompt_tokens) / span:.1f} tok/s,"
                f" generation {(now.generated_tokens - last.generated_tokens) / span:.1f} tok/s,"
                f" running {running}, waiting {waiting},"
                f" KV {used / total if total else 0.0:.1%} used,"
                f" prefix cache hit {hit} of prompt tokens")


async def log_throughput(metrics: Any, *, serves_http: bool, interval_s: float) -> None:
    """Log a throughput line every ``interval_s`` seconds while busy (cancel to stop)."""
    if interval_s <= 0:
        return
    log = ThroughputLog(metrics, serves_http=serves_http)
    while True:
        await asyncio.sleep(interval_s)
        line = log.tick()
        if line is not None:
            logger.info("%s", line)
