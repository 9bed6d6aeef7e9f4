"""The in-process telemetry hub and the worker's stats snapshot."""

from __future__ import annotations

import threading

import pytest
from fake_runtime import EventRecorder, FakeRuntime
from worker_support import barrier

from skippyd.engine.telemetry_events import (
    KINDS,
    DirectBatchFinished,
    RequestAdmitted,
    RequestFinished,
    RequestPreempted,
    RuntimeOperationFinished,
    StepFinished,
    WorkerFailed,
)
from skippyd.engine.worker.direct_batch import DirectIteration
from skippyd.engine.worker.generation_events import (
    CompleteEvent,
    GenerationRequest,
    TokenControl,
    TokenEvent,
)
from skippyd.engine.worker.telemetry import (
    Subscription,
    TelemetryHub,
)
from skippyd.engine.worker.worker_stats import WorkerStats

WAIT_S = 5.0


def note(text: str) -> WorkerFailed:
    """A summary event that carries ``text``."""
    return WorkerFailed(text)


def step(iteration: int) -> StepFinished:
    """A debug event."""
    return StepFinished(iteration, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1.0, 0.5, 0, 0, 0, 0)


def test_publish_without_subscribers_is_a_no_op():
    hub = TelemetryHub()
    hub.publish(note("x"))
    assert hub.num_published == 1


def test_full_subscription_drops_the_oldest_and_counts_it():
    hub = TelemetryHub()
    subscription = hub.subscribe(maxlen=2)
    for index in range(5):
        hub.publish(note(str(index)))
    assert subscription.num_dropped == 3
    assert [event.attributes["failure"] for event in subscription.drain()] == ["3", "4"]
    assert subscription.drain() == []


def test_events_are_frozen():
    hub = TelemetryHub()
    subscription = hub.subscribe()
    hub.publish(note("a"))
    event = subscription.get(0)
    assert event.attributes == {"failure": "a"} and event.name == "worker.failed"
    with pytest.raises(AttributeError):
        event.payload.failure = "b"  # type: ignore[misc]


def test_wait_for_skips_unmatched_events_and_times_out():
    hub = TelemetryHub()
    subscription = hub.subscribe()
    hub.publish(note("a"))
    hub.publish(RequestPreempted("r", 1))
    event = subscription.wait_for(lambda e: e.name == "request.preempted", WAIT_S)
    assert event is not None and event.payload == RequestPreempted("r", 1)
    assert subscription.wait_for(lambda e: e.name == "request.finished", 0.01) is None


def test_get_wakes_up_for_an_event_from_another_thread():
    hub = TelemetryHub()
    subscription = hub.subscribe()
    threading.Thread(target=hub.publish, args=(note("late"),), daemon=True).start()
    event = subscription.get(WAIT_S)
    assert event is not None and event.attributes["failure"] == "late"


def test_notify_callback_runs_and_its_failure_never_reaches_the_publisher():
    hub = TelemetryHub()
    notified = threading.Event()
    hub.subscribe(notify=notified.set)

    def broken() -> None:
        raise RuntimeError("observer bug")

    hub.subscribe(notify=broken)
    hub.publish(note("x"))
    assert notified.is_set()


def test_closed_subscription_receives_nothing():
    hub = TelemetryHub()
    with hub.subscribe() as subscription:
        hub.publish(note("before"))
    hub.publish(note("after"))
    assert [event.attributes["failure"] for event in subscription.drain()] == ["before"]
    assert subscription.closed
    assert subscription.get(0) is None


def test_a_summary_subscriber_gets_no_debug_event_and_none_is_built_for_it():
    hub = TelemetryHub()
    assert not hub.wants("debug") and hub.wants("summary")
    summary = hub.subscribe(level="summary")
    assert not hub.wants("debug")
    hub.publish(step(1))  # nobody wants it: dropped before it is an event
    assert hub.num_published == 0
    debug = hub.subscribe(level="debug")
    assert hub.wants("debug")
    hub.publish(step(2))
    hub.publish(note("x"))
    assert [e.name for e in summary.drain()] == ["worker.failed"]
    assert [(e.name, e.level) for e in debug.drain()] == [("worker.step", "debug"),
                                                         ("worker.failed", "summary")]
    debug.close()
    assert not hub.wants("debug")
    with pytest.raises(ValueError, match="level"):
        hub.subscribe(level="verbose")  # type: ignore[arg-type]


def test_every_kind_has_a_unique_wire_name_and_plain_attributes():
    assert len(KINDS) == len({kind.NAME for kind in KINDS.values()})
    assert all(name.count(".") == 1 for name in KINDS)
    attributes = step(3).wire_attributes()
    assert attributes["iteration"] == 3 and attributes["overhead_ms"] == 0.5


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
    events = [event.payload for event in subscription.drain()]
    steps = [e for e in events if isinstance(e, StepFinished)]
    assert len(steps) == 2
    first, second = steps
    assert first.prefill_tokens == 2 and second.decode_tokens == 1
    assert first.finished == 0 and second.finished == 1
    kv = first.components[0]
    assert kv.name == "kv-cells" and kv.available == 4096
    admitted = next(e for e in events if isinstance(e, RequestAdmitted))
    assert admitted.request_id == "r" and admitted.prompt_tokens == 2
    assert next(e for e in events if isinstance(e, RequestFinished)) == RequestFinished(
        "r", "length", 2, 2)
    direct = next(e for e in events if isinstance(e, DirectBatchFinished))
    assert direct.batch_size == 1 and direct.token_count == 3
    runtime_op = next(e for e in events if isinstance(e, RuntimeOperationFinished))
    assert runtime_op.operation == "probe"


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
        hub.publish(note(name))
    assert [e.attributes["failure"] for e in subscription.drain_through(notified[0])] == ["a"]
    assert subscription.drain_through(notified[0]) == []
    assert [e.attributes["failure"] for e in subscription.drain_through(notified[2])] == [
        "b", "c"]
