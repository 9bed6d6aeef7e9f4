"""ServingMetrics: request lifecycles, rolling windows, admission from worker events."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from http_support import wait_until

from skippyd.engine.telemetry_events import ComponentBytes, RequestAdmitted, StepFinished
from skippyd.engine.worker.generation_events import (
    AdmittedEvent,
    CompleteEvent,
    ErrorEvent,
    TokenAck,
    TokenEvent,
)
from skippyd.engine.worker.telemetry import TelemetryEvent, TelemetryHub
from skippyd.engine.worker.worker_errors import (
    QueueFullError,
    WorkerBackendError,
    WorkerStoppedError,
)
from skippyd.http.observability.metrics import ServingMetrics


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Lane:
    lane: int
    request_id: str
    phase: str = "prefill"
    prompt_tokens: int = 0
    generated_tokens: int = 0


@dataclass
class FakeStats:
    """What ServingMetrics reads from the worker's stats, lanes included."""

    lanes: tuple[Lane, ...] = ()
    num_active: int = 0
    num_waiting: int = 0
    num_preempted: int = 0
    num_iterations: int = 0
    failure: str | None = None
    kv_cells_used: int | None = None


def token() -> TokenEvent:
    return TokenEvent(7, TokenAck())


def sample(metrics: ServingMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_finished_request_feeds_every_window_and_counter() -> None:
    clock = FakeClock()
    metrics = ServingMetrics(clock=clock)
    timer = metrics.start_request("r1", 10)
    timer.on_event(AdmittedEvent(0))
    for step in (0.1, 0.05, 0.1):
        clock.now += step
        timer.on_event(token())
    clock.now += 0.05
    timer.on_event(CompleteEvent("length"))

    latency = metrics.latency_ms()
    assert latency["ttft"] == {"p50": pytest.approx(100.0), "p95": pytest.approx(100.0),
                               "p99": pytest.approx(100.0), "count": 1}
    assert latency["itl"]["count"] == 2 and latency["itl"]["p50"] == pytest.approx(75.0)
    assert latency["e2e"]["p50"] == pytest.approx(300.0)
    assert latency["queue"]["count"] == 1 and latency["queue"]["p50"] == pytest.approx(0.0)
    assert (metrics.num_prompt_tokens, metrics.num_generated_tokens) == (10, 3)
    assert metrics.outcomes == {"finished": 1, "failed": 0, "cancelled": 0}
    assert sample(metrics, "skippyd_requests_total", outcome="length") == 1
    assert sample(metrics, "skippyd_prompt_tokens_total") == 10
    assert sample(metrics, "skippyd_generation_tokens_total") == 3
    assert sample(metrics, "skippyd_time_to_first_token_seconds_sum") == pytest.approx(0.1)
    assert sample(metrics, "skippyd_inter_token_latency_seconds_count") == 2


def test_windows_forget_old_samples_but_counters_do_not() -> None:
    clock = FakeClock()
    metrics = ServingMetrics(clock=clock, window_s=60.0)
    clock.now += 10.0
    timer = metrics.start_request("r1", 4)
    clock.now += 0.5
    timer.on_event(token())
    timer.on_event(CompleteEvent("stop"))
    throughput = metrics.throughput()
    assert throughput["window_s"] == pytest.approx(10.5)  # only as long as we have run
    assert throughput["generation_tok_s"] == pytest.approx(1 / 10.5)
    assert throughput["prompt_tok_s"] == pytest.approx(4 / 10.5)
    clock.now += 61.0
    assert metrics.latency_ms()["ttft"]["count"] == 0
    assert metrics.throughput()["generation_tok_s"] == 0.0
    assert metrics.num_generated_tokens == 1
    assert sample(metrics, "skippyd_time_to_first_token_seconds_count") == 1



def test_windows_unread_for_hours_hold_only_their_last_minute() -> None:
    """A daemon nobody watches must not keep hours of samples (the soak found it)."""
    clock = FakeClock()
    metrics = ServingMetrics(clock=clock, window_s=60.0)
    for i in range(3600):  # one short request a second for an hour, never read
        timer = metrics.start_request(f"r{i}", 4)
        timer.on_event(token())
        timer.on_event(token())
        timer.on_event(CompleteEvent("stop"))
        clock.now += 1.0
    windows = (metrics.ttft, metrics.itl, metrics.e2e, metrics.prompt, metrics.generated)
    assert all(len(window._samples) <= 2 * 61 for window in windows)  # noqa: SLF001
    assert metrics.latency_ms()["e2e"]["count"] == 60
    assert sample(metrics, "skippyd_e2e_request_latency_seconds_count") == 3600

def test_nothing_counts_after_the_end() -> None:
    metrics = ServingMetrics(clock=FakeClock())
    timer = metrics.start_request("r1", 3)
    timer.on_event(token())
    timer.on_finished("stop")  # the HTTP side stopped it (stop string)
    timer.on_event(token())  # already in flight
    timer.on_event(CompleteEvent("stop"))
    timer.on_cancelled()
    assert metrics.num_generated_tokens == 1
    assert metrics.outcomes == {"finished": 1, "failed": 0, "cancelled": 0}


def test_failures_cancellations_and_rejections_are_told_apart() -> None:
    metrics = ServingMetrics(clock=FakeClock())
    metrics.start_request("full", 3).on_event(ErrorEvent(QueueFullError()))
    metrics.start_request("stopped", 3).on_refused(WorkerStoppedError())
    metrics.start_request("broken", 3).on_event(ErrorEvent(WorkerBackendError("boom")))
    metrics.start_request("gone", 3).on_cancelled()
    metrics.record_rejection("unauthorized")
    assert metrics.rejections == {"queue_full": 1, "unavailable": 1, "unauthorized": 1}
    assert metrics.outcomes == {"finished": 0, "failed": 1, "cancelled": 1}
    assert sample(metrics, "skippyd_requests_rejected_total", reason="queue_full") == 1
    assert sample(metrics, "skippyd_requests_total", outcome="failed") == 1
    assert sample(metrics, "skippyd_requests_total", outcome="cancelled") == 1
    assert metrics.num_prompt_tokens == 0  # none of them was prefilled


async def test_queue_time_ends_at_the_admission_event() -> None:
    clock = FakeClock()
    stats = FakeStats()
    hub = TelemetryHub()
    metrics = ServingMetrics(lambda: stats, clock=clock)
    metrics.attach(hub)
    try:
        first, second = metrics.start_request("a", 5), metrics.start_request("b", 5)
        clock.now += 1.5
        first.on_event(AdmittedEvent(0))
        first.on_event(token())
        hub.publish(step(step_ms=500.0, execution_ms=450.0))
        await wait_until(lambda: metrics.overhead_ratio() > 0)
        assert metrics.latency_ms()["queue"]["count"] == 1
        assert metrics.latency_ms()["queue"]["p50"] == pytest.approx(1500.0, abs=50.0)
        assert metrics.overhead_ratio() == pytest.approx(0.1)
        clock.now += 1.4
        second.on_event(AdmittedEvent(0))  # admitted, prefilling: no token yet
        second.on_event(AdmittedEvent(0))  # a repeat changes nothing
        assert metrics.latency_ms()["queue"]["count"] == 2
        assert sample(metrics, "skippyd_request_queue_time_seconds_sum") == pytest.approx(
            1.5 + 2.9, abs=0.1)
    finally:
        metrics.detach()


def step(*, step_ms: float = 1.0, execution_ms: float = 1.0,
         components: tuple[ComponentBytes, ...] = ()) -> StepFinished:
    return StepFinished(1, 1, 0, 0, 0, 0, 0, 1, 0, 0, step_ms, execution_ms, 0, 0, 0, 0,
                        components)


def test_matched_prompt_tokens_add_up_from_admissions() -> None:
    metrics = ServingMetrics(lambda: FakeStats())
    for cached in (0, 96, 32):
        metrics.observe_event(TelemetryEvent(RequestAdmitted("r", 128, cached, 1.0), 1, 0.0))
    assert metrics.prefix_cache()["matched_tokens"] == 128


def test_kv_cells_come_from_the_worker_or_else_from_the_policy_events() -> None:
    stats = FakeStats(num_active=1)
    metrics = ServingMetrics(lambda: stats, kv_cells_total=lambda: 256)
    assert metrics.kv_cells() == (0, 256)
    event = TelemetryEvent(step(components=(ComponentBytes("kv-cells", 100, 512),)), 1, 0.0)
    metrics.observe_event(event)
    assert metrics.kv_cells() == (100, 512)
    stats.num_active = 0
    assert metrics.kv_cells() == (0, 512)  # an idle worker holds no reservation
    stats.kv_cells_used = 42
    assert metrics.kv_cells() == (42, 512)
    assert sample(metrics, "skippyd_kv_cache_usage_ratio") == pytest.approx(42 / 512)
