"""Run-loop edge cases that used to lose or stall requests.

* A token consumer that vanishes without answering or cancelling counts as a stop.
* Works re-run one by one after an invalid batch do not teach the mixed-batch
  calibration (their summed time is not one batch's duration).
"""

from __future__ import annotations

import gc
import threading

from fake_runtime import EventRecorder, FakeRuntime

from skippyd.engine.runtime.contract import InvalidIterationError
from skippyd.engine.worker.commands import CancelCommand, SubmitCommand
from skippyd.engine.worker.generation_events import (
    CompleteEvent,
    ErrorEvent,
    GenerationRequest,
    TokenAck,
    TokenControl,
    TokenEvent,
)
from skippyd.engine.worker.worker_errors import RequestCancelledError

WAIT_S = 5.0


def test_an_unanswered_ack_that_is_dropped_reads_disconnected():
    ack = TokenAck()
    slot = ack.slot
    del ack
    gc.collect()
    assert slot.control is TokenControl.DISCONNECTED
    answered = TokenAck()
    slot = answered.slot
    answered.send(TokenControl.CONTINUE)
    del answered
    assert slot.control is TokenControl.CONTINUE


class TerminalOnly:
    """A consumer that keeps terminal events and drops token events unanswered."""

    def __init__(self) -> None:
        self.recorder = EventRecorder()

    def __call__(self, event) -> None:
        if not isinstance(event, TokenEvent):
            self.recorder(event)


def test_a_consumer_that_vanishes_is_stopped_within_a_turn(make_worker):
    runtime = FakeRuntime(lane_count=2)
    worker = make_worker(runtime)
    consumer = TerminalOnly()
    worker.handle(SubmitCommand(GenerationRequest("r", [1, 2], max_tokens=500),
                                        consumer))
    worker.run_turn()  # prefill and the first token, dropped by the consumer
    assert "r" in worker.generations
    worker.run_turn()  # its ack reads disconnected: the request ends here
    assert "r" not in worker.generations
    assert consumer.recorder.next(0) == CompleteEvent("stop")
    assert runtime.session_token_count("r") is None  # the lane is free again
    assert len(runtime.calls) <= 2


def test_a_vanished_consumer_frees_its_lane_on_a_running_worker(make_handle):
    runtime = FakeRuntime(lane_count=1)
    worker = make_handle(runtime)
    gone = TerminalOnly()
    worker.submit_generation(GenerationRequest("gone", [1, 2], max_tokens=100_000), gone)
    assert gone.recorder.next(WAIT_S) == CompleteEvent("stop")
    # The only lane is free: the next request runs to its end.
    following = EventRecorder()
    worker.submit_generation(GenerationRequest("next", [3, 4], max_tokens=3), following)
    tokens = []
    while isinstance(event := following.next(WAIT_S), TokenEvent):
        tokens.append(event.token)
        event.ack.send(TokenControl.CONTINUE)
    assert len(tokens) == 3 and event == CompleteEvent("length")
    assert sum(1 for call in runtime.calls for r in call if r.session_id == "gone") < 100


class SlowAfterInvalid(FakeRuntime):
    """After an invalid batch, the next calls (the one-by-one re-runs) take >= 30 ms."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.slow_calls = 0
        self.failed_calls: list[list[str]] = []

    def run_iteration(self, requests):
        if self.slow_calls:
            self.slow_calls -= 1
            threading.Event().wait(0.03)
        try:
            return super().run_iteration(requests)
        except InvalidIterationError:
            self.failed_calls.append([r.session_id for r in requests])
            if len(requests) > 1:
                self.slow_calls = len(requests)
            raise


def test_isolated_re_runs_do_not_switch_mixed_batches_off(make_worker):
    runtime = SlowAfterInvalid(lane_count=3, invalid_tokens={999})
    worker = make_worker(runtime)
    running = EventRecorder()
    worker.handle(SubmitCommand(GenerationRequest("a", [1, 2], max_tokens=50), running))
    for _ in range(4):  # prefill, then decode-only steps: a baseline for 1 decoder
        worker.run_turn()
    bad = EventRecorder()
    worker.handle(SubmitCommand(GenerationRequest("bad", [999, 5], max_tokens=5), bad))
    worker.run_turn()
    # A mixed batch, refused, then each work re-run alone (the bad one fails again).
    assert runtime.failed_calls == [["a", "bad"], ["bad"]]
    assert isinstance(_terminal(bad), ErrorEvent)
    assert worker.scheduler.mixed_prefill_viable
    worker.handle(SubmitCommand(GenerationRequest("c", [7, 8], max_tokens=2),
                                        EventRecorder()))
    worker.run_turn()
    assert {r.session_id for r in runtime.calls[-1]} == {"a", "c"}  # still mixing


def _terminal(recorder: EventRecorder):
    for event in recorder.pending():
        if not isinstance(event, TokenEvent):
            return event
    return None


def test_a_cancel_that_overtook_its_submit_cancels_it(make_worker):
    runtime = FakeRuntime()
    worker = make_worker(runtime)
    worker.handle(CancelCommand("late", overflowed=True))  # from the inbox, first
    recorder = EventRecorder()
    worker.submit(GenerationRequest("late", [1, 2], max_tokens=4), recorder)
    event = recorder.next(0)
    assert isinstance(event, ErrorEvent) and isinstance(event.error, RequestCancelledError)
    assert "late" not in worker.generations and runtime.calls == []
    again = EventRecorder()  # the id is free again afterwards
    worker.submit(GenerationRequest("late", [1, 2], max_tokens=1), again)
    assert "late" in worker.generations
