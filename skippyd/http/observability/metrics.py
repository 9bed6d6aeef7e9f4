"""Request-level serving metrics: rolling windows for ``skippyd top`` and Prometheus.

:class:`ServingMetrics` follows each HTTP generation through a :class:`RequestTimer` and
reads the worker's step and admission events; it keeps the last ``window_s`` seconds for
the control socket's snapshot and feeds a private ``prometheus_client`` registry (the
scrape-time series are in :mod:`~skippyd.http.observability.prometheus`). What is
recorded per token or per worker turn goes to the cheap
:mod:`~skippyd.http.observability.loop_metrics`: this thread's time comes out of the
decode. Every hook runs on the event loop thread; worker events arrive through the
loop's event relay, in order with the token deliveries of the same turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from skippyd import __version__
from skippyd.engine.telemetry_events import RequestAdmitted, StepFinished
from skippyd.engine.worker.settings import KV_COMPONENT
from skippyd.engine.worker.telemetry import Subscription, TelemetryEvent, TelemetryHub
from skippyd.engine.worker.worker_stats import WorkerStats
from skippyd.http.event_relay import relay_for
from skippyd.http.observability.loop_metrics import LoopCounter, LoopHistogram
from skippyd.http.observability.prometheus import StageCollector, metrics_route
from skippyd.http.observability.request_log import RequestLog
from skippyd.http.observability.request_timer import RequestTimer, rejection_reason
from skippyd.http.observability.windows import MAX_WINDOW_SAMPLES, Window, drop_before

__all__ = ["RequestTimer", "ServingMetrics", "metrics_route", "rejection_reason"]

logger = logging.getLogger(__name__)

#: Length of the rolling windows behind the snapshot's rates and percentiles.
WINDOW_S = 60.0
#: Events buffered between the worker and the event loop before the oldest drop.
EVENT_BUFFER = 4096
# NOTE: a long generation on a CPU runs for minutes (4096 tokens at 2 tok/s is 34 min):
# the buckets keep doubling up to an hour so TTFT and e2e never pile up in +Inf.
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                      1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0,
                      2560.0, 3600.0)
_STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

#: ``outcome`` labels of ``skippyd_requests_total``.
OUTCOMES = ("stop", "length", "failed", "cancelled")
#: ``reason`` labels of ``skippyd_requests_rejected_total`` the daemon itself gives.
REJECTION_REASONS = ("queue_full", "unauthorized", "unavailable", "invalid", "max_connections")

StatsSource = Callable[[], WorkerStats | None]
_LoopMetric = TypeVar("_LoopMetric", LoopHistogram, LoopCounter)


class ServingMetrics:
    """Request-level metrics of one stage, for the snapshot and for Prometheus.

    Args:
        stats_source: Returns the worker's current stats (None before the model loads).
        kv_cells_total: Returns the KV pool size in cells, until the worker reports it.
        prefix_cache_stats: Returns the prefix cache's counters (``queried_tokens``...).
        link_status: Returns a split stage's link counters (None on a whole-model stage).
        build_info: Labels of ``skippyd_build_info`` (version, model, stage, layers).
        request_log: Writes one line per ended request (``telemetry.log_requests``).
        window_s: Span of the rolling windows.
        clock: Monotonic clock, injectable for tests.
    """

    def __init__(
        self,
        stats_source: StatsSource | None = None,
        *,
        kv_cells_total: Callable[[], int] | None = None,
        prefix_cache_stats: Callable[[], Mapping[str, Any]] | None = None,
        link_status: Callable[[], Mapping[str, Any] | None] | None = None,
        build_info: Mapping[str, Any] | None = None,
        request_log: RequestLog | None = None,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.window_s = window_s
        self.started_at = clock()
        self._stats = stats_source or (lambda: None)
        self._kv_cells_total = kv_cells_total or (lambda: 0)
        self._prefix_cache_stats = prefix_cache_stats
        self._link_status = link_status or (lambda: None)
        self.build_info = dict(build_info or {"version": __version__})
        self.request_log = request_log or RequestLog(enabled=False)
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=MAX_WINDOW_SAMPLES)
        self.num_prompt_tokens = self.num_generated_tokens = 0
        self.outcomes = {"finished": 0, "failed": 0, "cancelled": 0}
        self.rejections: dict[str, int] = {}
        self.prefix = {"hits": 0, "misses": 0, "matched_tokens": 0}
        self._kv_event: tuple[int, int] | None = None
        self._subscription: Subscription | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self._build_windows()
        self.registry.register(StageCollector(self))
        # The process (CPU, RSS, fds), Python and GC views every Prometheus user expects.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    @classmethod
    def for_engine(cls, engine: Any, **kwargs: Any) -> ServingMetrics:
        """Metrics reading a :class:`~skippyd.daemon.assembly.StageEngine`'s worker."""
        def stats() -> WorkerStats | None:
            worker = engine.worker
            return None if worker is None else worker.stats()

        config = getattr(engine, "config", None)
        if config is not None:
            stage = config.stage
            kwargs.setdefault("build_info", {
                "version": __version__, "model": engine.model_id, "stage": stage.id,
                "stage_index": stage.index, "layer_start": stage.layer_start,
                "layer_end": "" if stage.layer_end is None else stage.layer_end})
            kwargs.setdefault("request_log", RequestLog(enabled=config.telemetry.log_requests))
        return cls(stats, kv_cells_total=lambda: engine.kv_pool_tokens,
                   prefix_cache_stats=getattr(engine, "prefix_cache_stats", None),
                   link_status=getattr(engine, "link_status", None), **kwargs)

    def stats(self) -> WorkerStats | None:
        """The worker's current stats (None before the model loads)."""
        return self._stats()

    def link_status(self) -> Mapping[str, Any] | None:
        """A split stage's link counters, or None."""
        return self._link_status()

    def prefix_cache(self) -> dict[str, Any]:
        """Prefix-cache figures: the cache's own when it reports them, else event counts."""
        if self._prefix_cache_stats is not None:
            return dict(self._prefix_cache_stats())
        hits, misses = self.prefix["hits"], self.prefix["misses"]
        return {"hits": hits, "misses": misses,
                "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                "matched_tokens": self.prefix["matched_tokens"], "queried_tokens": 0,
                "bytes_resident": 0, "bytes_host": 0, "evictions": 0}

    def _build_windows(self) -> None:
        reg, window, clock = self.registry, self.window_s, self.clock

        def latency(name: str, doc: str) -> Window:
            return Window(window, clock, self._loop_metric(
                LoopHistogram(name, doc, _LATENCY_BUCKETS_S)).observe)

        self.ttft = latency("skippyd_time_to_first_token_seconds",
                            "Submit to first generated token.")
        self.itl = latency("skippyd_inter_token_latency_seconds",
                           "Time between consecutive tokens of one request.")
        self.e2e = latency("skippyd_e2e_request_latency_seconds",
                           "Submit to the end of a finished generation.")
        self.queue = latency("skippyd_request_queue_time_seconds",
                             "Submit to the start of the first iteration that ran the request.")
        self.prompt = Window(window, clock, self._loop_metric(LoopCounter(
            "skippyd_prompt_tokens", "Prompt tokens processed.")).inc)
        self.generated = Window(window, clock, self._loop_metric(LoopCounter(
            "skippyd_generation_tokens", "Tokens generated.")).inc)
        self._outcomes = Counter("skippyd_requests", "Generations ended, by outcome.",
                                 ["outcome"], registry=reg)
        self._rejected = Counter("skippyd_requests_rejected",
                                 "Requests refused before running, by reason.", ["reason"],
                                 registry=reg)
        # Every known series exists from the start at 0, so rate() and dashboards see
        # them before the first request of a kind.
        for outcome in OUTCOMES:
            self._outcomes.labels(outcome=outcome)
        for reason in REJECTION_REASONS:
            self._rejected.labels(reason=reason)
        self._step = self._loop_metric(LoopHistogram(
            "skippyd_iteration_step_seconds", "Whole worker turn of one planned iteration.",
            _STEP_BUCKETS_S))
        self._overhead = self._loop_metric(LoopHistogram(
            "skippyd_iteration_overhead_seconds", "Iteration time outside llama_decode.",
            _STEP_BUCKETS_S))

    def _loop_metric(self, metric: _LoopMetric) -> _LoopMetric:
        self.registry.register(metric)
        return metric

    # -- request hooks (event loop) --------------------------------------------------------
    def start_request(self, request_id: str, num_prompt_tokens: int) -> RequestTimer:
        """Begin following one generation (call just before submitting it)."""
        return RequestTimer(self, request_id, num_prompt_tokens)

    def record_rejection(self, reason: str) -> None:
        """Count a request refused before it ran (``unauthorized``, ``queue_full``...)."""
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        self._rejected.labels(reason=reason).inc()

    def untrack(self, timer: RequestTimer) -> None:
        """A followed request ended."""
        self.request_log.ended(timer)

    def count_outcome(self, outcome: str, label: str | None = None) -> None:
        self.outcomes[outcome] += 1
        self._outcomes.labels(outcome=label or outcome).inc()

    # -- worker telemetry (event loop) -------------------------------------------------------
    def attach(self, hub: TelemetryHub) -> None:
        """Follow ``hub``'s events from now on. Call on the running event loop."""
        if self._subscription is not None:
            raise RuntimeError("ServingMetrics is already attached to a telemetry hub")
        relay = relay_for(asyncio.get_running_loop())
        subscription: Subscription | None = None

        def take_through(seq: int) -> None:
            for event in subscription.drain_through(seq) if subscription is not None else ():
                self.observe_event(event)

        def notify() -> None:  # worker thread: must never block
            # Through the loop's relay, in order with the step's tokens: a fold that
            # took the events published after it would run ahead of their tokens.
            seq = subscription.last_offered_seq if subscription is not None else sys.maxsize
            with contextlib.suppress(RuntimeError):  # loop closed: nobody reads metrics
                relay.post(take_through, seq)

        subscription = hub.subscribe(EVENT_BUFFER, notify)
        self._subscription = subscription

    def detach(self) -> None:
        """Stop following the hub. Idempotent."""
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None

    def observe_event(self, event: TelemetryEvent) -> None:
        """Fold one telemetry event into the metrics (once per worker turn: keep it lean)."""
        step = event.payload
        if isinstance(step, RequestAdmitted):
            self.prefix["matched_tokens"] += step.cached_tokens
            return
        if not isinstance(step, StepFinished):
            return
        step_s = step.step_ms / 1000.0
        overhead_s = step.overhead_ms / 1000.0
        now = self.clock()
        self._steps.append((now, step_s, overhead_s))
        drop_before(self._steps, now - self.window_s)
        self._step.observe(step_s)
        self._overhead.observe(overhead_s)
        self.prefix["hits"] = step.prefix_hits
        self.prefix["misses"] = step.prefix_misses
        for part in step.components:
            if part.name == KV_COMPONENT:
                self._kv_event = (part.used, part.available)

    # -- readings -----------------------------------------------------------------------------
    def effective_window_s(self) -> float:
        """The window actually covered so far (shorter than ``window_s`` at start-up)."""
        return max(1.0, min(self.window_s, self.clock() - self.started_at))

    def throughput(self) -> dict[str, float]:
        window = self.effective_window_s()
        return {"prompt_tok_s": sum(self.prompt.values()) / window,
                "generation_tok_s": sum(self.generated.values()) / window,
                "window_s": window}

    def latency_ms(self) -> dict[str, dict[str, Any]]:
        return {"ttft": self.ttft.percentiles_ms(), "itl": self.itl.percentiles_ms(),
                "e2e": self.e2e.percentiles_ms(), "queue": self.queue.percentiles_ms()}

    def overhead_ratio(self) -> float:
        """Share of worker step time spent outside llama_decode over the window."""
        horizon = self.clock() - self.window_s
        steps = [(s, o) for t, s, o in list(self._steps) if t >= horizon]
        total = sum(s for s, _ in steps)
        return sum(o for _, o in steps) / total if total > 0 else 0.0

    def kv_cells(self) -> tuple[int, int]:
        """(used, total) KV cells: the worker's count when it reports one, else the policy's."""
        stats = self._stats()
        total = self._kv_event[1] if self._kv_event else self._kv_cells_total()
        used = getattr(stats, "kv_cells_used", None)
        if used is None:  # NOTE: the policy's reservation, stale once the worker idles
            busy = stats is not None and (stats.num_active or stats.num_waiting)
            used = self._kv_event[0] if self._kv_event and busy else 0
        return int(used), int(total)
