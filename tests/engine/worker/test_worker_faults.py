"""Faults inside the worker: every request it took in is answered, whatever raised where.

``FaultSwitch`` raises at a named point of the worker's own code, as a bug there would.
A fatal point stops the worker after answering everything; a request-local one fails
only the requests of that step.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
from fake_runtime import EventRecorder, FakeRuntime
from worker_support import generate

from skippyd.engine.worker.direct_batch import DirectIteration
from skippyd.engine.worker.faults import FATAL_POINTS, FaultSwitch
from skippyd.engine.worker.generation_events import (
    CompleteEvent,
    ErrorEvent,
    GenerationRequest,
    TokenControl,
    TokenEvent,
)
from skippyd.engine.worker.worker_errors import (
    AdmissionTimeoutError,
    StalledError,
    WorkerBackendError,
    WorkerStoppedError,
)

#: A client must hear of a fault within this.
ANSWER_S = 1.0
WAIT_S = 5.0


def final_event(recorder: EventRecorder, streaming: bool, timeout_s: float = ANSWER_S):
    """Read a generation's events as a consumer would until its final one.

    A streaming consumer answers each token as it comes; a non-streaming one only reads
    (its acknowledgements stay unanswered until the end, as when a client reads the
    whole body at once).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            event = recorder.next(max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError("no final event within the time a client waits") from None
        if isinstance(event, TokenEvent):
            if streaming:
                event.ack.send(TokenControl.CONTINUE)
            continue
        if isinstance(event, CompleteEvent | ErrorEvent):
            return event


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("point", FATAL_POINTS)
def test_a_fatal_fault_answers_every_held_and_queued_request_and_stops(
        make_handle, point, streaming):
    runtime = FakeRuntime(lane_count=2)
    worker = make_handle(runtime, faults=FaultSwitch.parse(f"raise-in={point}:3"))
    failures: list[str] = []
    told = threading.Event()
    worker.on_failure(lambda reason: (failures.append(reason), told.set()))
    recorders = [EventRecorder() for _ in range(4)]
    for index, recorder in enumerate(recorders):
        worker.submit_generation(
            GenerationRequest(f"r{index}", [1, 2, 3], max_tokens=200), recorder)
    for recorder in recorders:
        event = final_event(recorder, streaming)
        assert isinstance(event, ErrorEvent), event
        assert isinstance(event.error, WorkerBackendError | WorkerStoppedError)
    assert told.wait(WAIT_S) and "fault injected in " + point in failures[0]
    worker.thread.join(WAIT_S)
    assert not worker.thread.is_alive()
    assert worker.failure is not None and worker.stats().failure == worker.failure
    late = EventRecorder()
    with pytest.raises(WorkerStoppedError):
        worker.submit_generation(GenerationRequest("late", [1], max_tokens=1), late)


def test_a_fault_preparing_a_session_fails_that_request_only(make_handle):
    runtime = FakeRuntime(lane_count=2)
    worker = make_handle(runtime, faults=FaultSwitch.parse("raise-in=prepare"))
    failed = EventRecorder()
    worker.submit_generation(GenerationRequest("unlucky", [1, 2], max_tokens=4), failed)
    event = final_event(failed, True)
    assert isinstance(event, ErrorEvent) and isinstance(event.error, WorkerBackendError)
    assert "prepare scheduler session" in event.error.message
    result = generate(worker, [1, 2], max_tokens=3, request_id="next")
    assert len(result.tokens) == 3 and worker.failure is None
    assert runtime.active_session_count() == 0  # nothing leaked by the failed one


def test_a_fault_in_a_direct_batch_fails_that_batch_only(make_batch_handle, blocked_worker):
    runtime = FakeRuntime(lane_count=2)
    worker = make_batch_handle(runtime, faults=FaultSwitch.parse("raise-in=direct"))
    _, release = blocked_worker(worker)
    replies = [worker.submit_iteration(DirectIteration(s, [1], sample_last=True))
               for s in ("a", "b")]
    release.set()
    for reply in replies:
        assert isinstance(reply.exception(timeout=ANSWER_S), WorkerBackendError)
    after = worker.submit_iteration(DirectIteration("c", [1], sample_last=True))
    assert after.result(timeout=WAIT_S).predicted >= 0 and worker.failure is None


def test_a_fatal_fault_on_a_later_stage_answers_every_direct_iteration(make_batch_handle,
                                                                        blocked_worker):
    worker = make_batch_handle(FakeRuntime(lane_count=2),
                               faults=FaultSwitch.parse("raise-in=command:2"))
    _, release = blocked_worker(worker)
    replies = [worker.submit_iteration(DirectIteration(s, [1], sample_last=True))
               for s in ("a", "b", "c")]
    release.set()
    for reply in replies:
        assert isinstance(reply.exception(timeout=ANSWER_S),
                          WorkerBackendError | WorkerStoppedError)
    worker.thread.join(WAIT_S)
    assert not worker.thread.is_alive() and worker.failure is not None


@pytest.mark.parametrize(("value", "message"), [
    ("raise-in=nowhere", "unknown point 'nowhere'"),
    ("raise-in=plan:0", "integer >= 1"),
    ("raise-in=plan:x", "integer >= 1"),
])
def test_a_bad_fault_value_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        FaultSwitch.parse(value)


def test_values_the_switch_does_not_own_arm_nothing():
    for value in (None, "", "hang-iteration"):
        switch = FaultSwitch.parse(value)
        switch.accept("r")
        switch.reach("plan")  # never raises
        assert switch.point is None


def test_a_request_that_gets_no_lane_in_time_fails_with_a_retryable_error(make_worker):
    worker = make_worker(FakeRuntime(lane_count=1), admission_timeout_s=30.0,
                         stall_timeout_s=60.0)
    holder, waiter = EventRecorder(), EventRecorder()
    worker.submit(GenerationRequest("holder", [1, 2], max_tokens=100), holder)
    worker.run_turn()
    worker.submit(GenerationRequest("waiter", [3, 4], max_tokens=4), waiter)
    worker.generations["waiter"].submitted_at -= 31.0  # as if it had waited 31 s
    worker.role._next_deadline_check = 0.0  # noqa: SLF001 - skip the 0.1 s check interval
    worker.run_turn()
    event = waiter.next(0)
    assert isinstance(event, ErrorEvent) and isinstance(event.error, AdmissionTimeoutError)
    assert event.error.status == 503 and event.error.retry_after_s > 0
    assert "runtime.admission_timeout_s" in event.error.message
    assert "waiter" not in worker.generations and "holder" in worker.generations


def test_an_admitted_request_that_makes_no_progress_fails(make_worker):
    runtime = FakeRuntime(lane_count=1)
    worker = make_worker(runtime, stall_timeout_s=60.0)
    recorder = EventRecorder()
    worker.submit(GenerationRequest("stuck", [1, 2], max_tokens=100), recorder)
    worker.run_turn()
    first = recorder.next(0)  # kept: a dropped ack would mean the consumer left
    assert isinstance(first, TokenEvent)
    worker.generations["stuck"].progressed_at -= 61.0
    worker.role._next_deadline_check = 0.0  # noqa: SLF001 - skip the 0.1 s check interval
    worker.run_turn()
    event = recorder.pending()[-1]
    assert isinstance(event, ErrorEvent) and isinstance(event.error, StalledError)
    assert "stuck" not in worker.generations and runtime.active_session_count() == 0
