"""Handle lifecycle, overload, panic containment and safe mode."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
from fake_runtime import EventRecorder, FakeRuntime, wait_until
from worker_support import barrier

from skippyd.config import parse_config
from skippyd.config.environment import SAFE_MODE_ENV
from skippyd.engine.telemetry_events import WorkerFailed, WorkerStarted
from skippyd.engine.worker.commands import ShutdownCommand
from skippyd.engine.worker.generation_events import ErrorEvent, GenerationRequest
from skippyd.engine.worker.handle import GenerationHandle
from skippyd.engine.worker.settings import WorkerSettings
from skippyd.engine.worker.telemetry import TelemetryHub
from skippyd.engine.worker.worker_errors import (
    QueueFullError,
    WorkerBackendError,
    WorkerStoppedError,
)

WAIT_S = 5.0


def fill_command_queue(worker: GenerationHandle) -> int:
    """Queue no-op commands until the bounded queue is full; returns how many fit."""
    count = 0
    while True:
        try:
            worker.execute_runtime_detached("filler", lambda _rt: None)
        except QueueFullError:
            return count
        count += 1


def test_safe_mode_from_the_environment_forces_one_lane(monkeypatch):
    monkeypatch.setenv(SAFE_MODE_ENV, "yes")
    runtime = FakeRuntime(lane_count=4)
    settings = WorkerSettings.for_stage(parse_config({"runtime": {"lane_count": 4}}), runtime)
    hub = TelemetryHub()
    subscription = hub.subscribe()
    with GenerationHandle(runtime, settings, telemetry=hub) as worker:
        assert worker.config.max_active_sequences == 1
    start = subscription.get(WAIT_S)
    assert isinstance(start.payload, WorkerStarted)
    assert start.payload.safe_mode is True
    assert start.payload.command_queue_capacity == 65  # 64 + 1 lane
    assert start.payload.cache_policy == "weighted_lpm_aging_dfs_waiting_prefix"


def test_a_runtime_that_is_not_one_is_refused():
    runtime = FakeRuntime()
    settings = WorkerSettings.derive(runtime, queue_capacity=1)
    with pytest.raises(TypeError, match="does not implement Runtime"):
        GenerationHandle(object(), settings)  # type: ignore[arg-type]


def test_bounded_command_queue_fails_closed_with_overload(make_handle, blocked_worker):
    worker = make_handle(FakeRuntime(lane_count=1), queue_capacity=1)
    assert worker.thread.name == "skippyd-worker"
    _, release = blocked_worker(worker)
    assert fill_command_queue(worker) == 8  # max(1 + 1 lane, 8)
    recorder = EventRecorder()
    with pytest.raises(QueueFullError, match="generation queue is full") as excinfo:
        worker.submit_generation(GenerationRequest("r", [1], max_tokens=1), recorder)
    assert excinfo.value.status == 429 and excinfo.value.retry_after_s > 0
    assert worker.stats().num_command_queue_full == 2  # the probe filler and this one
    worker.cancel("r")  # never raises, even on a full queue
    release.set()
    worker.close()  # delivers Shutdown and joins
    worker.close()  # idempotent
    assert not worker.thread.is_alive()
    assert recorder.pending() == []
    with pytest.raises(WorkerStoppedError, match="iteration scheduler stopped"):
        worker.submit_generation(GenerationRequest("r", [1], max_tokens=1), recorder)
    assert worker.failure is None  # stopped, not failed


def test_dropping_the_last_handle_stops_the_worker():
    runtime = FakeRuntime()
    worker = GenerationHandle(runtime, WorkerSettings.derive(runtime, queue_capacity=4))
    thread = worker.thread
    del worker
    gc.collect()
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_worker_panic_is_contained_and_fails_active_requests(make_handle):
    runtime = FakeRuntime()
    runtime.gate = threading.Event()
    worker = make_handle(runtime)
    subscription = worker.telemetry.subscribe()
    active, queued = EventRecorder(), EventRecorder()
    worker.submit_generation(GenerationRequest("active", [1, 2], max_tokens=4), active)
    assert runtime.entered.wait(WAIT_S)
    worker.submit_generation(GenerationRequest("queued", [3], max_tokens=4), queued)
    runtime.failures.append(ZeroDivisionError("bug in the runtime"))
    runtime.gate.set()
    for recorder in (active, queued):
        event = recorder.next(WAIT_S)
        assert isinstance(event, ErrorEvent)
        assert isinstance(event.error, WorkerBackendError)
        assert "worker panicked" in event.error.message
    worker.thread.join(WAIT_S)
    assert not worker.thread.is_alive()
    assert "worker panicked" in worker.failure
    assert worker.stats().failure == worker.failure
    panic = subscription.wait_for(lambda e: isinstance(e.payload, WorkerFailed), WAIT_S)
    assert panic is not None and panic.payload.failure
    with pytest.raises(WorkerStoppedError):
        worker.submit_generation(GenerationRequest("late", [1], max_tokens=1), queued)


class CaptureUnit:
    """Stands for a resource a runtime operation holds (released whatever the operation raises)."""

    def __init__(self, releases: list[int]) -> None:
        weakref.finalize(self, releases.append, 1)
        self.used = False

    def use(self, _runtime: object) -> None:
        self.used = True


def capture_operation(releases: list[int]):
    unit = CaptureUnit(releases)
    return unit.use, weakref.ref(unit)


def test_detached_capture_unit_releases_on_completion_rejection_and_shutdown_drop(
    make_handle, blocked_worker
):
    # Executed.
    worker = make_handle(FakeRuntime(lane_count=1), queue_capacity=1)
    releases: list[int] = []
    operation, unit = capture_operation(releases)
    worker.execute_runtime_detached("capture", operation)
    del operation
    barrier(worker)
    gc.collect()
    assert releases == [1]

    # Rejected on a full queue: never executed, released once.
    _, release = blocked_worker(worker)
    fill_command_queue(worker)
    releases.clear()
    operation, unit = capture_operation(releases)
    with pytest.raises(QueueFullError):
        worker.execute_runtime_detached("capture", operation)
    del operation
    gc.collect()
    assert releases == [1]
    release.set()
    assert wait_until(lambda: worker.stats().command_queue_depth == 0)

    # Dropped unexecuted at shutdown: queued behind a Shutdown command.
    _, release = blocked_worker(worker)
    releases.clear()
    worker._loop.commands.put_nowait(ShutdownCommand())
    operation, unit = capture_operation(releases)
    worker.execute_runtime_detached("capture", operation)
    del operation
    late = EventRecorder()
    worker.submit_generation(GenerationRequest("late", [1], max_tokens=1), late)
    release.set()
    worker.thread.join(WAIT_S)
    assert not worker.thread.is_alive()
    gc.collect()
    assert releases == [1]
    assert unit() is None
    event = late.next(WAIT_S)  # queued behind the Shutdown: answered, never run
    assert isinstance(event, ErrorEvent) and isinstance(event.error, WorkerStoppedError)
