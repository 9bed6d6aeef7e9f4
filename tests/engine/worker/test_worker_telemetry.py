"""The in-process telemetry hub and the worker's stats snapshot."""

from __future__ import annotations

import threading

import pytest
from fake_runtime import EventRecorder, FakeRuntime
from worker_support import barrier

from skippyd.engine.worker.commands import (
    CompleteEvent,
    GenerationRequest,
    TokenControl,
    TokenEvent,
    WorkerStats,
)
from skippyd.engine.worker.direct_batch import DirectIteration
from skippyd.engine.worker.telemetry import (
    SCHEDULER_DIRECT_ITERATION,
    SCHEDULER_ITERATION,
    SCHEDULER_RUNTIME_OPERATION,
    Subscription,
    TelemetryHub,
)

WAIT_S = 5.0


def test_publish_without_subscribers_is_a_no_op():
    hub = TelemetryHub()
    hub.publish("x", {"a": 1})
    assert hub.num_published == 1


def test_full_subscription_drops_the_oldest_and_counts_it():
    hub = TelemetryHub()
    subscription = hub.subscribe(maxlen=2)
    for index in range(5):
        hub.publish("tick", {"index": index})
    assert subscription.num_dropped == 3
    assert [event.attributes["index"] for event in subscription.drain()] == [3, 4]
    assert subscription.drain() == []


def test_events_are_immutable_copies():
    hub = TelemetryHub()
    subscription = hub.subscribe()
    attributes = {"a": 1}
    hub.publish("x", attributes)
    attributes["a"] = 2
    event = subscription.get(0)
    assert event.attributes["a"] == 1
    with pytest.raises(TypeError):
        event.attributes["a"] = 3  # type: ignore[index]


def test_wait_for_skips_unmatched_events_and_times_out():
    hub = TelemetryHub()
    subscription = hub.subscribe()
    hub.publish("a")
    hub.publish("b", {"n": 1})
    event = subscription.wait_for(lambda e: e.name == "b", WAIT_S)
    assert event is not None and event.attributes["n"] == 1
    assert subscription.wait_for(lambda e: e.name == "c", 0.01) is None


def test_get_wakes_up_for_an_event_from_another_thread():
    hub = TelemetryHub()
    subscription = hub.subscribe()
    threading.Thread(target=hub.publish, args=("late",), daemon=True).start()
    event = subscription.get(WAIT_S)
    assert event is not None and event.name == "late"


def test_notify_callback_runs_and_its_failure_never_reaches_the_publisher():
    hub = TelemetryHub()
    notified = threading.Event()
    hub.subscribe(notify=notified.set)

    def broken() -> None:
        raise RuntimeError("observer bug")

    hub.subscribe(notify=broken)
    hub.publish("x")
    assert notified.is_set()


def test_closed_subscription_receives_nothing():
    hub = TelemetryHub()
    with hub.subscribe() as subscription:
        hub.publish("before")
    hub.publish("after")
    assert [event.name for event in subscription.drain()] == ["before"]
    assert subscription.closed
    assert subscription.get(0) is None


def test_subscribe_rejects_an_empty_buffer():
    with pytest.raises(ValueError, match="maxlen"):
        TelemetryHub().subscribe(maxlen=0)


def test_workers_publish_iteration_direct_and_runtime_events(make_handle, make_batch_handle):
    hub = TelemetryHub()
    worker = make_handle(FakeRuntime(), hub)
    later_stage = make_batch_handle(FakeRuntime(), hub)
    subscription = hub.subscribe()
    recorder = EventRecorder()
    worker.submit_generation(GenerationRequest("r", [1, 2], max_tokens=2), recorder)
    for _ in range(2):
        event = recorder.next(WAIT_S)
        assert isinstance(event, TokenEvent)
        event.ack.send(TokenControl.CONTINUE)
    assert recorder.next(WAIT_S) == CompleteEvent("length")
    later_stage.submit_iteration(DirectIteration("direct", [1, 2, 3])).result(timeout=WAIT_S)
    later_stage.execute_runtime_detached("probe", lambda _rt: None)
    barrier(later_stage)
    events = subscription.drain()
    names = [event.name for event in events]
    assert names.count(SCHEDULER_ITERATION) == 2
    assert SCHEDULER_DIRECT_ITERATION in names and SCHEDULER_RUNTIME_OPERATION in names
    first, second = (e.attributes for e in events if e.name == SCHEDULER_ITERATION)
    assert first["skippy.scheduler.prefill_tokens"] == 2
    assert second["skippy.scheduler.decode_tokens"] == 1
    # Lifecycle counters only appear when they change (the second step finished "r").
    assert "skippy.scheduler.finished" not in first
    assert second["skippy.scheduler.finished"] == 1
    assert first["skippy.scheduler.component.kv-cells.available_bytes"] == 4096
    assert first["skippy.scheduler.component.kv-cells.free_bytes"] == (
        4096 - first["skippy.scheduler.component.kv-cells.used_bytes"])
    direct = next(e.attributes for e in events if e.name == SCHEDULER_DIRECT_ITERATION)
    assert direct["skippy.scheduler.batch_size"] == 1
    assert direct["skippy.scheduler.token_count"] == 3
    runtime_op = next(e.attributes for e in events if e.name == SCHEDULER_RUNTIME_OPERATION)
    assert runtime_op["skippy.scheduler.operation"] == "probe"


def test_stats_snapshot_is_published_without_touching_the_worker(make_batch_handle,
                                                                 blocked_worker):
    runtime = FakeRuntime(lane_count=2)
    worker = make_batch_handle(runtime)
    _, release = blocked_worker(worker)
    worker.execute_runtime_detached("queued", lambda _rt: None)
    stats = worker.stats()  # the worker is busy; reading must not wait for it
    assert isinstance(stats, WorkerStats)
    assert stats.command_queue_depth == 1
    release.set()
    worker.submit_iteration(DirectIteration("s", [1, 2])).result(timeout=WAIT_S)
    barrier(worker)
    stats = worker.stats()
    assert stats.num_direct_iterations == 1
    assert stats.active_runtime_sessions == 1
    assert stats.wave_fullness == pytest.approx(0.5)
    assert stats.num_runtime_operations >= 2
    assert stats.failure is None


def test_a_consumer_can_drain_up_to_the_event_it_was_notified_of() -> None:
    hub = TelemetryHub()
    notified: list[int] = []
    subscription: Subscription | None = None

    def notify() -> None:
        assert subscription is not None
        notified.append(subscription.last_offered_seq)

    subscription = hub.subscribe(maxlen=8, notify=notify)
    assert subscription.last_offered_seq == -1
    for name in ("a", "b", "c"):
        hub.publish(name, {})
    assert [event.name for event in subscription.drain_through(notified[0])] == ["a"]
    assert subscription.drain_through(notified[0]) == []
    assert [event.name for event in subscription.drain_through(notified[2])] == ["b", "c"]
