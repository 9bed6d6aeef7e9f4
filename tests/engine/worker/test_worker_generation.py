"""Planned generations through the worker."""

from __future__ import annotations

import threading
import time

import pytest
from fake_runtime import EventRecorder
from worker_support import barrier, generate, on_worker

from skippyd.engine.runtime.contract import DecodeFailedError
from skippyd.engine.telemetry_events import (
    RequestAdmitted,
    RequestFinished,
    RequestPreempted,
    StepFinished,
)
from skippyd.engine.worker import generations
from skippyd.engine.worker.arrivals import Arrivals
from skippyd.engine.worker.generation_events import (
    CompleteEvent,
    ErrorEvent,
    GenerationRequest,
    TokenControl,
    TokenEvent,
)
from skippyd.engine.worker.telemetry import TelemetryHub
from skippyd.engine.worker.worker_errors import (
    InvalidRequestError,
    QueueFullError,
    RequestCancelledError,
    WorkerBackendError,
)

WAIT_S = 5.0


def drain_tokens(recorder: EventRecorder) -> tuple[list[int], object]:
    """Collect token events (answering Continue) until the terminal event."""
    tokens = []
    while True:
        event = recorder.next(WAIT_S)
        if not isinstance(event, TokenEvent):
            return tokens, event
        tokens.append(event.token)
        event.ack.send(TokenControl.CONTINUE)


def test_worker_batches_and_completes_default_generations(
    runtime_factory, make_handle, blocked_worker
):
    runtime = runtime_factory(lane_count=2, script={"a": [10], "b": [20]})
    worker = make_handle(runtime)
    subscription = worker.telemetry.subscribe()
    _, release = blocked_worker(worker)
    first, second = EventRecorder(), EventRecorder()
    worker.submit_generation(GenerationRequest("a", [1, 2], max_tokens=1), first)
    worker.submit_generation(GenerationRequest("b", [3, 4], max_tokens=1), second)
    release.set()

    for recorder, token in ((first, 10), (second, 20)):
        event = recorder.next(WAIT_S)
        assert isinstance(event, TokenEvent) and event.token == token
        event.ack.send(TokenControl.CONTINUE)
        assert recorder.next(WAIT_S) == CompleteEvent("length")
    step = subscription.wait_for(lambda e: isinstance(e.payload, StepFinished), WAIT_S)
    assert step is not None
    assert step.payload.admitted == 2
    assert step.payload.finished == 2
    barrier(worker)
    assert runtime.sampled_sessions() == [["a", "b"]]
    stats = worker.stats()
    assert (stats.num_finished, stats.num_active, stats.num_waiting) == (2, 0, 0)
    assert runtime.active_session_count() == 0


def test_token_control_is_applied_without_blocking_the_scheduler_iteration(
    runtime_factory, make_worker
):
    runtime = runtime_factory(lane_count=2)
    worker = make_worker(runtime)
    recorder = EventRecorder()
    worker.submit(GenerationRequest("r", [1, 2], max_tokens=8), recorder)
    worker.run_turn()
    first = recorder.next(0)
    assert isinstance(first, TokenEvent)
    assert "r" in worker.generations

    worker.run_turn()  # the unanswered ack does not hold the next decode back
    second = recorder.next(0)
    assert isinstance(second, TokenEvent)
    assert "r" in worker.generations

    first.ack.send(TokenControl.CONTINUE)
    worker.run_turn()  # answered acks are applied first: Continue keeps it running
    assert isinstance(recorder.next(0), TokenEvent)
    assert "r" in worker.generations
    second.ack.send(TokenControl.STOP)
    worker.run_turn()
    assert "r" not in worker.generations
    assert "r" not in worker.scheduler
    assert recorder.next(0) == CompleteEvent("stop")
    assert runtime.session_token_count("r") is None


def test_end_of_generation_stops_without_a_token_event(runtime_factory, make_handle):
    runtime = runtime_factory(script={"r": [5, 6, 2]}, eog_tokens={2})
    worker = make_handle(runtime)
    recorder = EventRecorder()
    worker.submit_generation(GenerationRequest("r", [1], max_tokens=10), recorder)
    tokens, terminal = drain_tokens(recorder)
    assert tokens == [5, 6]
    assert terminal == CompleteEvent("stop")


def test_a_generation_runs_to_max_tokens(runtime_factory, make_handle):
    worker = make_handle(runtime_factory())
    result = generate(worker, [1, 2, 3], max_tokens=4)
    # The fake samples 100 + the session's length: prompt of 3, then one per decode.
    assert result.tokens == [103, 104, 105, 106]
    assert result.finish_reason == "length"


def test_consumer_stop_ends_generation_with_stop(runtime_factory, make_handle):
    worker = make_handle(runtime_factory(kv_pool_tokens=1 << 20))
    # Far from max_tokens, so the consumer's Stop ends it, not the policy.
    result = generate(worker, [1, 2], max_tokens=1 << 19,
                      on_token=lambda _t: TokenControl.STOP)
    assert result.tokens == [102]
    assert result.finish_reason == "stop"
    barrier(worker)
    stats = worker.stats()
    assert stats.num_active == 0
    # The consumer ended it before the policy did: the policy counts it as cancelled
    # (the client still gets its finish reason).
    assert (stats.num_finished, stats.num_cancelled) == (0, 1)


def test_cancel_ends_a_running_generation_and_frees_its_lane(runtime_factory, make_handle):
    runtime = runtime_factory()
    hub = TelemetryHub()
    subscription = hub.subscribe(level="summary")
    worker = make_handle(runtime, hub)
    recorder = EventRecorder()
    worker.submit_generation(GenerationRequest("c", [1, 2], max_tokens=1000), recorder)
    first = recorder.next(WAIT_S)
    assert isinstance(first, TokenEvent)
    worker.cancel("c")
    worker.cancel("c")  # idempotent
    first.ack.send(TokenControl.CONTINUE)
    barrier(worker)
    assert worker.stats().num_cancelled == 1
    assert on_worker(worker, lambda rt: rt.session_token_count("c")) is None
    *tokens, final = recorder.pending()
    assert all(isinstance(event, TokenEvent) for event in tokens)
    assert isinstance(final, ErrorEvent) and isinstance(final.error, RequestCancelledError)
    finished = [e.payload for e in subscription.drain() if isinstance(e.payload, RequestFinished)]
    assert [(f.request_id, f.reason) for f in finished] == [("c", "cancelled")]
    assert finished[0].generated_tokens >= 1 and finished[0].message


def test_kv_exhaustion_preempts_a_victim_instead_of_failing(runtime_factory, make_handle):
    runtime = runtime_factory(lane_count=3, kv_pool_tokens=64)
    hub = TelemetryHub()
    subscription = hub.subscribe(level="summary")
    worker = make_handle(runtime, hub)
    # Another user of the context (a direct session) holds 30 cells the policy cannot see.
    on_worker(worker, lambda rt: rt.sessions.__setitem__("other", 30))
    recorders = {name: EventRecorder() for name in ("a", "b")}
    for name, recorder in recorders.items():
        worker.submit_generation(GenerationRequest(name, [1, 2, 3, 4], max_tokens=20),
                                    recorder)
    for recorder in recorders.values():
        tokens, terminal = drain_tokens(recorder)
        assert terminal == CompleteEvent("length")
        assert tokens == list(range(104, 124))  # unchanged by the recompute
    barrier(worker)
    assert worker.stats().num_preempted >= 1
    assert worker.stats().num_failed == 0
    events = [e.payload for e in subscription.drain()]
    preempted = [e for e in events if isinstance(e, RequestPreempted)]
    assert len(preempted) == worker.stats().num_preempted
    admitted = [e.request_id for e in events if isinstance(e, RequestAdmitted)]
    assert sorted(admitted) == ["a", "b"]  # once each: a readmission is no admission
    assert sorted((e.request_id, e.reason) for e in events
                  if isinstance(e, RequestFinished)) == [("a", "length"), ("b", "length")]


def test_malformed_request_in_a_batch_fails_alone(runtime_factory, make_handle,
                                                  blocked_worker):
    runtime = runtime_factory(invalid_tokens={999})
    worker = make_handle(runtime)
    _, release = blocked_worker(worker)
    good, bad = EventRecorder(), EventRecorder()
    worker.submit_generation(GenerationRequest("good", [1, 2], max_tokens=2), good)
    worker.submit_generation(GenerationRequest("bad", [999, 2], max_tokens=2), bad)
    release.set()
    event = bad.next(WAIT_S)
    assert isinstance(event, ErrorEvent)
    assert isinstance(event.error, InvalidRequestError)
    assert "vocabulary" in event.error.message
    tokens, terminal = drain_tokens(good)
    assert len(tokens) == 2 and terminal == CompleteEvent("length")


def test_runtime_failure_fails_held_generations_but_keeps_serving(runtime_factory,
                                                                  make_handle):
    runtime = runtime_factory()
    runtime.failures.append(DecodeFailedError("llama_decode failed with code -3"))
    worker = make_handle(runtime)
    recorder = EventRecorder()
    worker.submit_generation(GenerationRequest("r", [1], max_tokens=3), recorder)
    event = recorder.next(WAIT_S)
    assert isinstance(event, ErrorEvent) and isinstance(event.error, WorkerBackendError)
    assert "code -3" in event.error.message
    assert worker.failure is None
    assert generate(worker, [1], max_tokens=2).finish_reason == "length"


def test_full_waiting_queue_answers_with_overload(runtime_factory, make_handle,
                                                  blocked_worker):
    worker = make_handle(runtime_factory(lane_count=1), queue_capacity=1)
    _, release = blocked_worker(worker)
    recorders = [EventRecorder() for _ in range(3)]
    for index, recorder in enumerate(recorders):
        worker.submit_generation(GenerationRequest(f"r{index}", [1], max_tokens=1), recorder)
    release.set()
    # r0 and r1 are drained in one turn: r0 waits (capacity 1), r1 overflows.
    overloaded = recorders[1].next(WAIT_S)
    assert isinstance(overloaded, ErrorEvent) and isinstance(overloaded.error, QueueFullError)
    assert overloaded.error.status == 429 and overloaded.error.retry_after_s > 0
    assert "generation queue is full" in overloaded.error.message


@pytest.mark.parametrize(("overrides", "field"), [
    ({"request_id": ""}, "request_id"),
    ({"prompt_tokens": []}, "prompt_tokens"),
    ({"prompt_tokens": [1, -4]}, "prompt_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt_tokens": [1] * 100}, "KV cache"),
])
def test_malformed_generation_is_rejected_before_queueing(runtime_factory, make_handle,
                                                         overrides, field):
    worker = make_handle(runtime_factory(kv_pool_tokens=64))
    request = GenerationRequest(**{"request_id": "x", "prompt_tokens": [1], "max_tokens": 1,
                                   **overrides})
    with pytest.raises(InvalidRequestError, match=field):
        worker.submit_generation(request, EventRecorder())
    assert worker.stats().command_queue_depth == 0


def test_duplicate_request_id_is_an_invalid_request_event(runtime_factory, make_handle,
                                                         blocked_worker):
    worker = make_handle(runtime_factory())
    _, release = blocked_worker(worker)
    first, duplicate = EventRecorder(), EventRecorder()
    worker.submit_generation(GenerationRequest("same", [1], max_tokens=2), first)
    worker.submit_generation(GenerationRequest("same", [2], max_tokens=2), duplicate)
    release.set()
    event = duplicate.next(WAIT_S)
    assert isinstance(event, ErrorEvent) and isinstance(event.error, InvalidRequestError)
    assert "already queued or active: same" in event.error.message
    tokens, terminal = drain_tokens(first)
    assert len(tokens) == 2 and terminal == CompleteEvent("length")


def test_requests_arriving_together_at_an_idle_worker_share_its_first_step(
        runtime_factory, make_handle):
    runtime = runtime_factory(lane_count=2, script={"a": [10], "b": [20]})
    arrivals = Arrivals()
    worker = make_handle(runtime, arrivals=arrivals, burst_wait_s=WAIT_S)
    barrier(worker)  # idle
    waiting = threading.Event()
    worker.add_wait_hook(lambda: waiting.set())
    first, second = EventRecorder(), EventRecorder()
    with arrivals.arriving():  # "b" is still being prepared when "a" reaches the worker
        worker.submit_generation(GenerationRequest("a", [1, 2], max_tokens=1), first)
        assert waiting.wait(WAIT_S)  # the worker waits for it instead of running "a"
    worker.submit_generation(GenerationRequest("b", [3, 4], max_tokens=1), second)
    for recorder in (first, second):
        _, end = drain_tokens(recorder)
        assert end == CompleteEvent("length")
    assert runtime.sampled_sessions() == [["a", "b"]]


def test_a_lone_request_at_an_idle_worker_does_not_wait_for_a_burst(
        runtime_factory, make_handle):
    runtime = runtime_factory(lane_count=2, script={"a": [10]})
    worker = make_handle(runtime, arrivals=Arrivals(), burst_wait_s=60.0)
    recorder = EventRecorder()
    worker.submit_generation(GenerationRequest("a", [1, 2], max_tokens=1), recorder)
    tokens, end = drain_tokens(recorder)  # well before the 60 s a burst may take
    assert (tokens, end) == ([10], CompleteEvent("length"))


def test_a_lone_stream_that_comes_back_starts_without_a_quiet_spell(
        runtime_factory, make_handle, monkeypatch):
    runtime = runtime_factory(lane_count=2, script={"a": [10, 11], "b": [20]})
    worker = make_handle(runtime, arrivals=Arrivals(), burst_wait_s=60.0)
    first = EventRecorder()
    worker.submit_generation(GenerationRequest("a", [1, 2], max_tokens=2), first)
    assert drain_tokens(first) == ([10, 11], CompleteEvent("length"))  # alone, two steps
    # Anything but starting at once would now hold "b" for a minute.
    monkeypatch.setattr(generations, "BURST_QUIET_S", 60.0)
    second = EventRecorder()
    worker.submit_generation(GenerationRequest("b", [3, 4], max_tokens=1), second)
    assert drain_tokens(second) == ([20], CompleteEvent("length"))


def test_the_last_of_a_wave_coming_back_alone_still_waits_a_quiet_spell(
        runtime_factory, make_handle, blocked_worker, monkeypatch):
    runtime = runtime_factory(lane_count=2, script={"a": [10], "b": [20, 21], "c": [30]})
    worker = make_handle(runtime, arrivals=Arrivals(), burst_wait_s=60.0)
    _, release = blocked_worker(worker)
    recorders = {name: EventRecorder() for name in "abc"}
    worker.submit_generation(GenerationRequest("a", [1, 2], max_tokens=1), recorders["a"])
    worker.submit_generation(GenerationRequest("b", [3, 4], max_tokens=2), recorders["b"])
    release.set()
    for name in "ab":  # "a" ends a step before "b", which leaves the worker idle alone
        assert drain_tokens(recorders[name])[1] == CompleteEvent("length")
    quiet_s = 0.3
    monkeypatch.setattr(generations, "BURST_QUIET_S", quiet_s)
    sent = time.monotonic()
    worker.submit_generation(GenerationRequest("c", [5, 6], max_tokens=1), recorders["c"])
    assert drain_tokens(recorders["c"]) == ([30], CompleteEvent("length"))
    # "a"'s client may still be on its way back: "c" waited for it.
    assert time.monotonic() - sent >= quiet_s


def test_requests_that_finished_together_are_awaited_together_when_they_come_back(
        runtime_factory, make_handle, blocked_worker):
    runtime = runtime_factory(lane_count=2, script={"a": [10], "b": [20], "c": [30],
                                                     "d": [40]})
    worker = make_handle(runtime, arrivals=Arrivals(), burst_wait_s=60.0)
    _, release = blocked_worker(worker)
    recorders = {name: EventRecorder() for name in "abcd"}
    for name in "ab":
        worker.submit_generation(GenerationRequest(name, [1, 2], max_tokens=1),
                                 recorders[name])
    release.set()
    for name in "ab":  # they finish in one step and the worker goes idle
        assert drain_tokens(recorders[name])[1] == CompleteEvent("length")
    worker.submit_generation(GenerationRequest("c", [1, 2], max_tokens=1), recorders["c"])
    # Their clients come back a moment apart, longer than a lone request is held.
    time.sleep(0.05)
    worker.submit_generation(GenerationRequest("d", [3, 4], max_tokens=1), recorders["d"])
    for name in "cd":
        assert drain_tokens(recorders[name])[1] == CompleteEvent("length")
    assert runtime.sampled_sessions() == [["a", "b"], ["c", "d"]]
