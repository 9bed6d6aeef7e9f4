"""Request-level serving metrics: rolling windows for ``skippyd top`` and Prometheus.

:class:`ServingMetrics` follows each HTTP generation through its life (submitted,
admitted, first token, each token, finished / failed / cancelled / rejected) through a
per-request :class:`RequestTimer`, and reads the worker's ``stage.scheduler_iteration``
events for iteration times and prefix-cache counts. It keeps the last
``window_s`` seconds of samples for the control socket's snapshot (tok/s, p50/p95/p99)
and feeds a private ``prometheus_client`` registry served by :func:`metrics_route`.

Every hook runs on the event loop thread. The worker thread only publishes to the hub;
its events reach this object through ``loop.call_soon_threadsafe``, one callback per
event, so they interleave with the token deliveries of the same worker turn in the order
the worker produced them (that is how a request's admission turn is recognised).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from skippyd.engine.worker.commands import (
    CompleteEvent,
    ErrorEvent,
    GenerationEvent,
    TokenEvent,
    WorkerStats,
)
from skippyd.engine.worker.settings import KV_COMPONENT
from skippyd.engine.worker.telemetry import (
    SCHEDULER_ITERATION,
    SCHEDULER_RUNTIME_OPERATION,
    Subscription,
    TelemetryEvent,
    TelemetryHub,
)
from skippyd.http.link_metrics import link_families

logger = logging.getLogger(__name__)

#: Length of the rolling windows behind the snapshot's rates and percentiles.
WINDOW_S = 60.0
#: Samples one latency window keeps at most (older ones are dropped first).
MAX_WINDOW_SAMPLES = 20_000
#: Events buffered between the worker and the event loop before the oldest drop.
EVENT_BUFFER = 4096
_ATTR = "skippy.scheduler."
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                      1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

StatsSource = Callable[[], WorkerStats | None]


def _drop_before(samples: deque, horizon: float) -> None:
    """Drop samples (timestamp first) older than ``horizon`` from the left of ``samples``."""
    while samples and samples[0][0] < horizon:
        samples.popleft()


class _Window:
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

    def add(self, value: float) -> None:
        now = self._clock()
        with self._lock:
            self._samples.append((now, value))
            _drop_before(self._samples, now - self._window_s)
        self._sink(value)

    def values(self) -> list[float]:
        """Values still inside the window, oldest first (older ones are pruned)."""
        horizon = self._clock() - self._window_s
        with self._lock:
            _drop_before(self._samples, horizon)
            return [value for _, value in self._samples]

    def percentiles_ms(self) -> dict[str, Any]:
        """``{"p50", "p95", "p99"}`` in ms (None when empty) and ``count``."""
        values = self.values()
        if not values:
            return {"p50": None, "p95": None, "p99": None, "count": 0}
        p50, p95, p99 = (float(v) * 1000.0 for v in np.percentile(values, [50, 95, 99]))
        return {"p50": p50, "p95": p95, "p99": p99, "count": len(values)}


class RequestTimer:
    """One generation's lifecycle, reported to :class:`ServingMetrics`.

    Every method is idempotent after the request reached a terminal state, so callers
    may report liberally (a token that arrives after a consumer Stop is ignored).
    """

    def __init__(self, metrics: ServingMetrics, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_generated_tokens = 0
        self.submitted_at = metrics.clock()
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.outcome: str | None = None
        """None while running; then "stop", "length", "failed", "cancelled" or "rejected"."""
        self._metrics = metrics
        self._prompt_counted = False

    @property
    def done(self) -> bool:
        return self.outcome is not None

    def on_submitted(self) -> None:
        """The backend accepted the request: it now waits for a lane."""
        self._metrics.track_admission(self)

    def on_event(self, event: GenerationEvent) -> None:
        """Record a worker event as it reaches the event loop."""
        if isinstance(event, TokenEvent):
            self.on_token()
        elif isinstance(event, CompleteEvent):
            self.on_finished(event.finish_reason)
        elif isinstance(event, ErrorEvent):
            self.on_failed(event.error)

    def on_refused(self, error: Exception) -> None:
        """Submitting raised ``error``: the request never ran."""
        self.on_rejected(rejection_reason(error) or str(getattr(error, "kind", "error")))

    def on_token(self) -> None:
        """A generated token arrived."""
        if self.done:
            return
        metrics = self._metrics
        now = metrics.clock()
        if self.first_token_at is None:
            self.first_token_at = now
            metrics.ttft.add(now - self.submitted_at)
            self._count_prompt()
        else:
            metrics.itl.add(now - (self.last_token_at or now))
        self.last_token_at = now
        self.num_generated_tokens += 1
        metrics.num_generated_tokens += 1
        metrics.generated.add(1)

    def on_finished(self, reason: str) -> None:
        """The generation ended normally (``"stop"`` or ``"length"``)."""
        if self._end(reason):
            self._count_prompt()
            self._metrics.e2e.add(self._metrics.clock() - self.submitted_at)
            self._metrics.count_outcome("finished", reason)

    def on_failed(self, error: Exception) -> None:
        """The worker reported an error; a full waiting queue counts as a rejection."""
        kind = rejection_reason(error)
        if kind is not None:
            self.on_rejected(kind)
        elif self._end("failed"):
            self._metrics.count_outcome("failed")

    def on_cancelled(self) -> None:
        """The client went away (or the handler failed) before the end."""
        if self._end("cancelled"):
            self._metrics.count_outcome("cancelled")

    def on_rejected(self, reason: str) -> None:
        """The request was refused before it ran (queue full, stopped...)."""
        if self._end("rejected"):
            self._metrics.record_rejection(reason)

    def _end(self, outcome: str) -> bool:
        if self.done:
            return False
        self.outcome = outcome
        self._metrics.untrack(self)
        return True

    def _count_prompt(self) -> None:
        if not self._prompt_counted:
            self._prompt_counted = True
            self._metrics.num_prompt_tokens += self.num_prompt_tokens
            self._metrics.prompt.add(self.num_prompt_tokens)


def rejection_reason(error: Exception) -> str | None:
    """The rejection label of a worker error, or None when it is a real failure."""
    kind = getattr(error, "kind", None)
    if getattr(error, "status", None) == 429:
        return "queue_full"
    if kind == "stopped":
        return "unavailable"
    if kind == "invalid_request":
        return "invalid"
    return None


class ServingMetrics:
    """Request-level metrics of one stage, for the snapshot and for Prometheus.

    Args:
        stats_source: Returns the worker's current stats (None before the model loads).
        kv_cells_total: Returns the KV pool size in cells, until the worker reports it.
        link_status: Returns a split stage's link status (None otherwise): its round
            trips, queues and busy time become ``skippyd_link_*`` families.
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
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.window_s = window_s
        self.started_at = clock()
        self._stats = stats_source or (lambda: None)
        self._kv_cells_total = kv_cells_total or (lambda: 0)
        self._prefix_cache_stats = prefix_cache_stats
        self.link_status = link_status or (lambda: None)
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=MAX_WINDOW_SAMPLES)
        self.num_prompt_tokens = self.num_generated_tokens = 0
        self.outcomes = {"finished": 0, "failed": 0, "cancelled": 0}
        self.rejections: dict[str, int] = {}
        self.prefix = {"hits": 0, "misses": 0, "matched_tokens": 0}
        self._kv_event: tuple[int, int] | None = None
        self._awaiting: dict[str, RequestTimer] = {}
        self._subscription: Subscription | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self._build_windows()
        self.registry.register(_StageCollector(self))

    @classmethod
    def for_engine(cls, engine: Any, **kwargs: Any) -> ServingMetrics:
        """Metrics reading a :class:`~skippyd.daemon.assembly.StageEngine`'s worker."""
        def stats() -> WorkerStats | None:
            worker = engine.worker
            return None if worker is None else worker.stats()
        return cls(stats, kv_cells_total=lambda: engine.ctx_size,
                   prefix_cache_stats=getattr(engine, "prefix_cache_stats", None),
                   link_status=getattr(engine, "link_status", None), **kwargs)

    def prefix_cache(self) -> dict[str, Any]:
        """Prefix-cache figures: the cache's own when it reports them, else event counts."""
        if self._prefix_cache_stats is not None:
            return dict(self._prefix_cache_stats())
        hits, misses = self.prefix["hits"], self.prefix["misses"]
        return {"hits": hits, "misses": misses,
                "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                "matched_tokens": self.prefix["matched_tokens"],
                "bytes_resident": 0, "bytes_host": 0, "evictions": 0}

    def _build_windows(self) -> None:
        reg, window, clock = self.registry, self.window_s, self.clock

        def latency(name: str, doc: str) -> _Window:
            return _Window(window, clock, Histogram(
                name, doc, registry=reg, buckets=_LATENCY_BUCKETS_S).observe)

        self.ttft = latency("skippyd_time_to_first_token_seconds",
                            "Submit to first generated token.")
        self.itl = latency("skippyd_inter_token_latency_seconds",
                           "Time between consecutive tokens of one request.")
        self.e2e = latency("skippyd_e2e_request_latency_seconds",
                           "Submit to the end of a finished generation.")
        self.queue = latency("skippyd_request_queue_time_seconds",
                             "Submit to the start of the first iteration that ran the request.")
        self.prompt = _Window(window, clock, Counter(
            "skippyd_prompt_tokens", "Prompt tokens processed.", registry=reg).inc)
        self.generated = _Window(window, clock, Counter(
            "skippyd_generation_tokens", "Tokens generated.", registry=reg).inc)
        self._outcomes = Counter("skippyd_requests", "Generations ended, by outcome.",
                                 ["outcome"], registry=reg)
        self._rejected = Counter("skippyd_requests_rejected",
                                 "Requests refused before running, by reason.", ["reason"],
                                 registry=reg)
        self._step = Histogram("skippyd_iteration_step_seconds", "Whole worker turn of one "
                               "planned iteration.", registry=reg, buckets=_STEP_BUCKETS_S)
        self._overhead = Histogram("skippyd_iteration_overhead_seconds", "Iteration time "
                                   "outside llama_decode.", registry=reg, buckets=_STEP_BUCKETS_S)

    # -- request hooks (event loop) --------------------------------------------------------
    def start_request(self, request_id: str, num_prompt_tokens: int) -> RequestTimer:
        """Begin following one generation (call just before submitting it)."""
        return RequestTimer(self, request_id, num_prompt_tokens)

    def record_rejection(self, reason: str) -> None:
        """Count a request refused before it ran (``unauthorized``, ``queue_full``...)."""
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        self._rejected.labels(reason=reason).inc()

    def track_admission(self, timer: RequestTimer) -> None:
        if self._subscription is not None:  # admission is only visible through events
            self._awaiting[timer.request_id] = timer

    def untrack(self, timer: RequestTimer) -> None:
        # A request that finished before its admission turn was seen keeps waiting
        # for that turn's event, which comes right after it.
        if timer.outcome not in ("stop", "length"):
            self._awaiting.pop(timer.request_id, None)

    def count_outcome(self, outcome: str, label: str | None = None) -> None:
        self.outcomes[outcome] += 1
        self._outcomes.labels(outcome=label or outcome).inc()

    # -- worker telemetry (event loop) -------------------------------------------------------
    def attach(self, hub: TelemetryHub) -> None:
        """Follow ``hub``'s events from now on. Call on the running event loop."""
        if self._subscription is not None:
            raise RuntimeError("ServingMetrics is already attached to a telemetry hub")
        loop = asyncio.get_running_loop()
        subscription: Subscription | None = None

        def pop_one() -> None:
            event = subscription.get(0) if subscription is not None else None
            if event is not None:
                self.observe_event(event)

        def notify() -> None:  # worker thread: must never block
            with contextlib.suppress(RuntimeError):  # loop closed: nobody reads metrics
                loop.call_soon_threadsafe(pop_one)

        subscription = hub.subscribe(EVENT_BUFFER, notify)
        self._subscription = subscription

    def detach(self) -> None:
        """Stop following the hub. Idempotent."""
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
        self._awaiting.clear()

    def observe_event(self, event: TelemetryEvent) -> None:
        """Fold one telemetry event into the metrics."""
        attrs = event.attributes
        if event.name == SCHEDULER_RUNTIME_OPERATION:
            self.prefix["matched_tokens"] += int(attrs.get(_ATTR + "cache_matched_tokens", 0))
        if event.name != SCHEDULER_ITERATION:
            return
        step_s = float(attrs.get(_ATTR + "step_ms", 0.0)) / 1000.0
        overhead_s = float(attrs.get(_ATTR + "overhead_ms", 0.0)) / 1000.0
        now = self.clock()
        self._steps.append((now, step_s, overhead_s))
        _drop_before(self._steps, now - self.window_s)
        self._step.observe(step_s)
        self._overhead.observe(overhead_s)
        self.prefix["hits"] = int(attrs.get(_ATTR + "prefix_hits", self.prefix["hits"]))
        self.prefix["misses"] = int(attrs.get(_ATTR + "prefix_misses", self.prefix["misses"]))
        kv = _ATTR + f"component.{KV_COMPONENT}."
        if kv + "used_bytes" in attrs:
            self._kv_event = (int(attrs[kv + "used_bytes"]), int(attrs[kv + "available_bytes"]))
        lag_s = max(0.0, time.time() - event.timestamp_s)
        self._note_admissions(now - lag_s - step_s)

    def _note_admissions(self, iteration_start: float) -> None:
        """Requests seen running in this turn left the queue when it started."""
        if not self._awaiting:
            return
        stats = self._stats()
        in_lanes = {lane.request_id for lane in getattr(stats, "lanes", ())}
        for req_id, timer in list(self._awaiting.items()):
            if timer.first_token_at is None and not timer.done and req_id not in in_lanes:
                continue
            del self._awaiting[req_id]
            timer.admitted_at = max(timer.submitted_at, iteration_start)
            self.queue.add(timer.admitted_at - timer.submitted_at)

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


class _StageCollector(Collector):
    """Gauges and worker counters read at scrape time."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Any]:
        return []  # collected on demand: values depend on the live worker

    def collect(self) -> Iterator[Any]:
        m = self._metrics
        stats = m._stats() or WorkerStats()
        used, total = m.kv_cells()
        for name, doc, value in (
            ("requests_running", "Generations holding a lane.", stats.num_active),
            ("requests_waiting", "Generations waiting for a lane.", stats.num_waiting),
            ("kv_cache_usage_ratio", "Used share of the KV cell pool (0..1).",
             used / total if total else 0.0),
            ("kv_cache_cells_used", "KV cells in use.", used),
            ("worker_failed", "1 once the worker has failed.", int(stats.failure is not None)),
        ):
            yield GaugeMetricFamily("skippyd_" + name, doc, value=value)
        prefix = m.prefix_cache()
        for name, doc, value in (
            ("prefix_cache_queries", "Prefix-cache lookups.", prefix["hits"] + prefix["misses"]),
            ("prefix_cache_hits", "Prefix-cache lookups that hit.", prefix["hits"]),
            ("prefix_cache_evictions", "Prefix-cache entries evicted.", prefix["evictions"]),
            ("preemptions", "Sequences preempted by the scheduler.", stats.num_preempted),
            ("iterations", "Planned iterations run by the worker.", stats.num_iterations),
            ("direct_iterations", "Direct iterations run by the worker (a later split "
             "stage's batches).", stats.num_direct_iterations),
        ):
            yield CounterMetricFamily("skippyd_" + name, doc, value=value)
        yield from link_families(m.link_status())


def metrics_route(metrics: ServingMetrics, path: str = "/metrics") -> Route:
    """The Starlette route serving ``metrics.registry`` in the Prometheus text format."""
    async def endpoint(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
    return Route(path, endpoint, methods=["GET"])

