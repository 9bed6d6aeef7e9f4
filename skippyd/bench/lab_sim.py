"""Scheduler simulation on a virtual clock.

The real policy ``Scheduler`` is driven by a modelled runtime: every plan "takes" the time
the cost model says, every sampling row yields a token. There is no model and no runtime,
so the numbers compare scheduling policies with each other, not with hardware.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from skippyd.engine.policy import (
    CacheAffinity,
    IterationPlan,
    IterationPrediction,
    PrefixRestore,
    PrefixRestoreKind,
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
)

logger = logging.getLogger(__name__)


class SimulationError(ValueError):
    """The simulated workload is invalid, or the scheduler stopped making progress."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One simulated request; its prompt is ``token_offset + 0 .. prompt_tokens``."""

    id: str
    arrival_us: int
    prompt_tokens: int
    output_tokens: int
    prefix_tokens: int = 0
    """Leading prompt tokens restored from a cache instead of computed."""
    token_offset: int = 0
    cache_affinity: CacheAffinity = field(default_factory=CacheAffinity)

    def prompt(self) -> list[int]:
        """The prompt token ids."""
        return list(range(self.token_offset, self.token_offset + self.prompt_tokens))


@dataclass(frozen=True, slots=True)
class RuntimeCostModel:
    """Modelled duration of one iteration, in microseconds."""

    iteration_overhead_us: int = 50
    prefill_token_us: int = 2
    decode_batch_us: int = 100
    decode_sequence_us: int = 20

    def iteration_us(self, plan: IterationPlan) -> int:
        """Modelled duration of ``plan``."""
        prompt_tokens, decode_rows = plan.phase_counts()
        return self.iteration_us_for(prompt_tokens, decode_rows)

    def iteration_us_for(self, prompt_tokens: int, decode_rows: int) -> int:
        """Overhead + prompt tokens + (batch + per-row cost if any decode row), at least 1."""
        duration = self.iteration_overhead_us + self.prefill_token_us * prompt_tokens
        if decode_rows:
            duration += self.decode_batch_us + self.decode_sequence_us * decode_rows
        return max(1, duration)


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """What one simulated request experienced (all times in µs of virtual clock)."""

    id: str
    arrival_us: int
    first_scheduled_us: int
    first_token_us: int
    completion_us: int
    max_inter_token_us: int
    generated_tokens: int

    @property
    def queue_wait_us(self) -> int:
        """Arrival to first scheduled work."""
        return self.first_scheduled_us - self.arrival_us

    @property
    def ttft_us(self) -> int:
        """Arrival to first token."""
        return self.first_token_us - self.arrival_us

    @property
    def latency_us(self) -> int:
        """Arrival to completion."""
        return self.completion_us - self.arrival_us


@dataclass(frozen=True, slots=True)
class SimulationReport:
    """Outcome of one simulation."""

    requests: tuple[RequestMetrics, ...]
    makespan_us: int
    iterations: int
    prefill_iterations: int
    decode_iterations: int
    mixed_iterations: int
    mean_batch_size: float
    mean_token_occupancy: float
    """Mean of ``plan.token_count / max_tokens_per_iteration``."""

    def request(self, request_id: str) -> RequestMetrics:
        """Metrics of one request by id."""
        for metrics in self.requests:
            if metrics.id == request_id:
                return metrics
        raise KeyError(request_id)

    @property
    def throughput_rps(self) -> float:
        """Completed requests per second of virtual time."""
        return len(self.requests) / (self.makespan_us / 1e6) if self.makespan_us else 0.0


def percentile(values: Iterable[float], p: float) -> float:
    """Sorted value at index ``ceil(len * p / 100) - 1`` (clamped); 0 when empty."""
    ordered = sorted(values)
    if not ordered:
        return 0
    index = min(max(math.ceil(len(ordered) * p / 100) - 1, 0), len(ordered) - 1)
    return ordered[index]


def validate_requests(requests: Iterable[SimRequest]) -> list[SimRequest]:
    """Check a workload and return it sorted by (arrival, id).

    Raises:
        SimulationError: Empty workload, duplicate ids, empty prompt or output, or a
            prefix longer than its prompt.
    """
    ordered = sorted(requests, key=lambda request: (request.arrival_us, request.id))
    if not ordered:
        raise SimulationError("simulation needs at least one request")
    ids = [request.id for request in ordered]
    if len(set(ids)) != len(ids):
        raise SimulationError(f"simulated request ids must be unique: {sorted(ids)}")
    for request in ordered:
        if request.prompt_tokens <= 0 or request.output_tokens <= 0:
            raise SimulationError(f"request {request.id}: prompt and output must be > 0 tokens")
        if not 0 <= request.prefix_tokens <= request.prompt_tokens:
            raise SimulationError(f"request {request.id}: prefix_tokens "
                                  f"{request.prefix_tokens} exceeds prompt {request.prompt_tokens}")
        if request.arrival_us < 0:
            raise SimulationError(f"request {request.id}: arrival_us must be >= 0")
    return ordered


def make_sequence(request: SimRequest) -> ScheduledSequence:
    """The policy sequence a simulated request submits."""
    sequence = ScheduledSequence(request.id, tuple(request.prompt()), request.output_tokens)
    if request.prefix_tokens:
        sequence.with_prefix_restore(PrefixRestore(
            f"sim-prefix-{request.id}", request.prefix_tokens, PrefixRestoreKind.RESIDENT_KV))
    return sequence.with_cache_affinity(request.cache_affinity)


class _Tracker:
    """Per-request timestamps and per-iteration counters gathered during a run."""

    def __init__(self, requests: list[SimRequest]) -> None:
        self.arrival = {request.id: request.arrival_us for request in requests}
        self.first_scheduled: dict[str, int] = {}
        self.first_token: dict[str, int] = {}
        self.last_token: dict[str, int] = {}
        self.max_gap: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.completed: dict[str, int] = {}
        self.kinds = {"prefill": 0, "decode": 0, "mixed": 0}
        self.batch_total = 0
        self.occupancy_total = 0.0
        self.iterations = 0

    def scheduled(self, plan: IterationPlan, now_us: int) -> None:
        for work in plan.work:
            self.first_scheduled.setdefault(work.sequence_id, now_us)

    def executed(self, plan: IterationPlan, now_us: int, budget: int) -> None:
        for work in plan.work:
            if not work.sample_last:
                continue
            request_id = work.sequence_id
            self.first_token.setdefault(request_id, now_us)
            if request_id in self.last_token:
                gap = now_us - self.last_token[request_id]
                self.max_gap[request_id] = max(self.max_gap.get(request_id, 0), gap)
            self.last_token[request_id] = now_us
            self.tokens[request_id] = self.tokens.get(request_id, 0) + 1
        prompt_tokens, decode_rows = plan.phase_counts()
        kind = "mixed" if prompt_tokens and decode_rows else "prefill" if prompt_tokens else "decode"
        self.kinds[kind] += 1
        self.iterations += 1
        self.batch_total += len(plan.work)
        self.occupancy_total += plan.token_count / budget

    def metrics(self, request_id: str) -> RequestMetrics:
        return RequestMetrics(
            id=request_id,
            arrival_us=self.arrival[request_id],
            first_scheduled_us=self.first_scheduled[request_id],
            first_token_us=self.first_token.get(request_id, self.completed[request_id]),
            completion_us=self.completed[request_id],
            max_inter_token_us=self.max_gap.get(request_id, 0),
            generated_tokens=self.tokens.get(request_id, 0),
        )


class _VirtualClock:
    """Scheduler clock reading the simulation's virtual time, in seconds."""

    def __init__(self) -> None:
        self.now_us = 0

    def __call__(self) -> float:
        return self.now_us / 1e6


def simulate(
    config: SchedulerConfig, cost: RuntimeCostModel, requests: Iterable[SimRequest]
) -> SimulationReport:
    """Run ``requests`` through a real ``Scheduler`` on a virtual clock.

    Raises:
        SimulationError: Invalid workload, a refused submit, or an empty plan while
            requests are pending ("scheduler stalled").
    """
    pending = validate_requests(requests)
    clock = _VirtualClock()
    scheduler = Scheduler(config, clock=clock)
    tracker = _Tracker(pending)
    budget = scheduler.config.max_tokens_per_iteration
    arrivals = list(pending)
    while len(tracker.completed) < len(pending):
        _submit_arrivals(scheduler, arrivals, clock.now_us)
        snapshot = scheduler.snapshot()
        if not snapshot.active_ids and not snapshot.waiting_ids:
            clock.now_us = max(clock.now_us, arrivals[0].arrival_us)
            continue
        plan = scheduler.plan_iteration()
        if plan.is_empty():
            raise SimulationError(f"scheduler stalled at {clock.now_us} us with "
                                  f"{len(snapshot.waiting_ids)} waiting requests")
        tracker.scheduled(plan, clock.now_us)
        duration_us = cost.iteration_us(plan)
        clock.now_us += duration_us
        tracker.executed(plan, clock.now_us, budget)
        predictions = [IterationPrediction(index, 1)
                       for index, work in enumerate(plan.work) if work.sample_last]
        scheduler.observe_iteration_duration(plan, duration_us / 1e6)
        scheduler.complete_iteration(plan, predictions)
        for request_id in tracker.first_scheduled.keys() - tracker.completed.keys():
            if request_id not in scheduler:
                tracker.completed[request_id] = clock.now_us
    return _report(tracker, pending, clock.now_us)


def _submit_arrivals(scheduler: Scheduler, arrivals: list[SimRequest], now_us: int) -> None:
    while arrivals and arrivals[0].arrival_us <= now_us:
        request = arrivals.pop(0)
        try:
            scheduler.submit(make_sequence(request))
        except ValueError as error:
            raise SimulationError(f"request {request.id} was refused: {error}") from error


def _report(tracker: _Tracker, requests: list[SimRequest], makespan_us: int) -> SimulationReport:
    iterations = max(tracker.iterations, 1)
    return SimulationReport(
        requests=tuple(tracker.metrics(request.id) for request in requests),
        makespan_us=makespan_us,
        iterations=tracker.iterations,
        prefill_iterations=tracker.kinds["prefill"],
        decode_iterations=tracker.kinds["decode"],
        mixed_iterations=tracker.kinds["mixed"],
        mean_batch_size=tracker.batch_total / iterations,
        mean_token_occupancy=tracker.occupancy_total / iterations,
    )


def family_switches(report: SimulationReport, family_of: dict[str, int]) -> int:
    """How often consecutive first-scheduled requests belong to different families."""
    order = sorted(report.requests, key=lambda m: (m.first_scheduled_us, m.id))
    families = [family_of[metrics.id] for metrics in order]
    return sum(1 for previous, current in zip(families, families[1:], strict=False) if previous != current)
