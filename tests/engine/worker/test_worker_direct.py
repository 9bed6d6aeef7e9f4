"""Direct iterations."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import pytest

from skippyd.engine.runtime.contract import (
    IterationOutput,
    IterationSample,
    RowPhase,
)
from skippyd.engine.worker.direct_batch import (
    DirectGroup,
    DirectIteration,
    direct_coalesce_target,
    take_direct_iteration_batch,
    validate_direct_iteration,
)
from skippyd.engine.worker.settings import effective_lane_count
from skippyd.engine.worker.worker_errors import (
    DeadlineExceededError,
    InvalidRequestError,
    RequestCancelledError,
    WorkerBackendError,
)

WAIT_S = 5.0


@dataclass
class Item:
    name: str
    session_id: str
    num_rows: int
    group: DirectGroup | None = None


def names(items) -> list[str]:
    return [item.name for item in items]


def run(worker, session_id, token_ids, **fields):
    """Submit one direct iteration and wait for its outcome."""
    iteration = DirectIteration(session_id, token_ids, **fields)
    return worker.submit_iteration(iteration).result(timeout=WAIT_S)


def test_a_malformed_direct_iteration_is_refused_before_queueing(runtime_factory,
                                                                 make_batch_handle):
    worker = make_batch_handle(runtime_factory())
    with pytest.raises(InvalidRequestError, match="at least one token"):
        worker.submit_iteration(DirectIteration("s", []))
    assert worker.stats().command_queue_depth == 0


@pytest.mark.parametrize(("continuous_batching", "batch_size"), [(True, 2), (False, 1)])
def test_continuous_batching_controls_multi_request_direct_iterations(
    runtime_factory, make_batch_handle, blocked_worker, continuous_batching, batch_size
):
    lanes = effective_lane_count(2, False, continuous_batching)
    queue = deque([Item("a", "a", 1), Item("b", "b", 1)])
    assert names(take_direct_iteration_batch(queue, lanes, 2048)) == ["a", "b"][:batch_size]
    assert len(queue) == 2 - batch_size

    runtime = runtime_factory(lane_count=2)
    worker = make_batch_handle(runtime, continuous_batching=continuous_batching)
    _, release = blocked_worker(worker)
    replies = [worker.submit_iteration(DirectIteration(s, [1, 2], sample_last=True))
               for s in ("a", "b")]
    release.set()
    outcomes = [reply.result(timeout=WAIT_S) for reply in replies]
    assert [outcome.batch_size for outcome in outcomes] == [batch_size, batch_size]
    assert len(runtime.calls) == 2 // batch_size


@pytest.mark.parametrize(("active", "queued", "max_batch", "target"),
                         [(1, 1, 16, 1), (16, 1, 16, 16), (32, 4, 16, 16), (0, 4, 16, 4)])
def test_direct_coalescing_tracks_active_sessions_without_penalizing_singletons(
    active, queued, max_batch, target
):
    assert direct_coalesce_target(active, queued, max_batch) == target


def test_feature_driver_iterations_enforce_the_native_batch_shape():
    validate_direct_iteration([1], [], None)
    validate_direct_iteration([1, 2], [0, 1], None)
    validate_direct_iteration([1, 2], [0, 1, 2, 3, 0, 1, 2, 3], None)  # mRoPE: 4 per token
    with pytest.raises(InvalidRequestError, match="at least one token"):
        validate_direct_iteration([], [], None)
    with pytest.raises(InvalidRequestError, match="token-major"):
        validate_direct_iteration([1, 2], [0, 1, 2], None)
    with pytest.raises(InvalidRequestError, match="512-token configured iteration limit"):
        validate_direct_iteration([1] * 513, [], 512)
    with pytest.raises(InvalidRequestError, match="2048-token configured iteration limit"):
        validate_direct_iteration([1] * 2049, [], None)
    rows = np.zeros((3, 8), dtype=np.float32)
    validate_direct_iteration([], [], None, rows)
    with pytest.raises(InvalidRequestError, match="disagree"):
        validate_direct_iteration([1, 2], [], None, rows)


def test_direct_iteration_batch_defers_duplicate_sessions():
    queue = deque([Item("first", "same", 1), Item("second", "same", 1), Item("o", "other", 1)])
    assert names(take_direct_iteration_batch(queue, 8, 2048)) == ["first", "o"]
    assert names(queue) == ["second"]


def test_direct_prefill_wave_never_exceeds_configured_native_batch_tokens():
    queue = deque(Item(f"p{i}", f"s{i}", 128) for i in range(8))
    batch = take_direct_iteration_batch(queue, 16, 512)
    assert names(batch) == ["p0", "p1", "p2", "p3"]
    assert sum(item.num_rows for item in batch) == 512
    assert names(queue) == ["p4", "p5", "p6", "p7"]


def oversized_head() -> deque[Item]:
    return deque([Item("prefill-a", "prefill-a", 384), Item("prefill-b", "prefill-b", 256),
                  Item("decode-a", "decode-a", 1), Item("decode-b", "decode-b", 1)])


def test_direct_wave_packs_decode_rows_queued_behind_an_oversized_prefill_chunk():
    queue = oversized_head()
    queue.append(Item("late", "late", 1))
    batch = take_direct_iteration_batch(queue, 4, 512)
    assert names(batch) == ["prefill-a", "decode-a", "decode-b", "late"]
    assert names(queue) == ["prefill-b"]


def test_deferred_prefill_chunk_stays_ahead_of_requests_it_did_not_reach():
    queue = oversized_head()
    batch = take_direct_iteration_batch(queue, 2, 512)
    assert names(batch) == ["prefill-a", "decode-a"]
    assert names(queue) == ["prefill-b", "decode-b"]


def test_deferred_prefill_chunk_is_not_overtaken_by_its_own_session():
    queue = deque([Item("prefill-a", "prefill-a", 384), Item("same-256", "same", 256),
                   Item("same-1", "same", 1), Item("decode-a", "decode-a", 1)])
    batch = take_direct_iteration_batch(queue, 4, 512)
    assert names(batch) == ["prefill-a", "decode-a"]
    assert names(queue) == ["same-256", "same-1"]


def test_a_direct_iteration_trims_a_session_that_is_ahead(runtime_factory, make_batch_handle):
    runtime = runtime_factory()
    worker = make_batch_handle(runtime)
    first = run(worker, "s", [1, 2, 3, 4], sample_last=True)
    assert first.predicted == 104 and first.batch_size == 1 and first.session_alignment is None
    outcome = run(worker, "s", [7], positions=[2], sample_last=True,
                  phase=RowPhase.DECODE, target_token_count=2)
    assert outcome.session_alignment.before_token_count == 4
    assert outcome.session_alignment.after_token_count == 2
    assert outcome.predicted == 103  # the session is 3 tokens long after the trim + row
    assert runtime.calls[-1][0].phase is RowPhase.DECODE
    unsampled = run(worker, "s", [8])
    assert unsampled.predicted == -1


class _MalformedRuntime:
    """Wraps the fake and corrupts its output."""

    def __init__(self, runtime, corrupt) -> None:
        self._runtime = runtime
        self._corrupt = corrupt

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def run_iteration(self, requests):
        return self._corrupt(self._runtime.run_iteration(requests))


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda out: IterationOutput(output_rows=[None] * 3, samples=out.samples),
     "returned 3 outputs for 2 requests"),
    (lambda out: IterationOutput(out.output_rows, [IterationSample(5, 1, False)]),
     "sample references request 5, but only 2 requests ran"),
    (lambda out: IterationOutput(out.output_rows, [*out.samples, out.samples[0]]),
     "duplicate sample for request 0"),
])
def test_malformed_runtime_output_fails_every_caller(runtime_factory, make_batch_handle,
                                                    blocked_worker, corrupt, message):
    fake = runtime_factory()
    worker = make_batch_handle(_MalformedRuntime(fake, corrupt))
    _, release = blocked_worker(worker)
    replies = [worker.submit_iteration(DirectIteration(s, [1], sample_last=True))
               for s in ("a", "b")]
    release.set()
    for reply in replies:
        error = reply.exception(timeout=WAIT_S)
        assert isinstance(error, WorkerBackendError)
        assert message in error.message


def test_a_link_group_runs_whole_and_alone():
    a, b = DirectGroup("a", 3), DirectGroup("b", 2)
    queue = deque([Item("a0", "s0", 1, a), Item("a1", "s1", 1, a), Item("loose", "s9", 1),
                   Item("a2", "s2", 1, a), Item("b0", "s3", 1, b), Item("b1", "s4", 1, b)])
    # Wider than the group batch size of 2: a group is never cut, nor joined.
    assert names(take_direct_iteration_batch(queue, 2, 512)) == ["a0", "a1", "a2"]
    assert names(queue) == ["loose", "b0", "b1"]
    assert names(take_direct_iteration_batch(queue, 8, 512)) == ["loose"]
    assert names(take_direct_iteration_batch(queue, 8, 512)) == ["b0", "b1"]


def test_coalescing_waits_for_a_group_to_be_complete_and_no_longer():
    assert direct_coalesce_target(8, 1, 4, DirectGroup("g", 3)) == 3
    assert direct_coalesce_target(8, 5, 4, DirectGroup("g", 2)) == 2


def test_a_direct_iteration_already_past_its_deadline_is_refused_before_queueing(
    runtime_factory, make_batch_handle
):
    runtime = runtime_factory()
    worker = make_batch_handle(runtime)
    with pytest.raises(DeadlineExceededError):
        worker.submit_iteration(DirectIteration("s", [1], deadline=time.monotonic() - 1.0))
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(RequestCancelledError):
        worker.submit_iteration(DirectIteration("s", [1], cancelled=cancelled))
    assert worker.stats().command_queue_depth == 0 and runtime.calls == []


def test_an_iteration_that_expires_behind_a_busy_worker_never_reaches_the_runtime(
    runtime_factory, make_batch_handle, blocked_worker
):
    runtime = runtime_factory()
    worker = make_batch_handle(runtime)
    _, release = blocked_worker(worker)
    late = DirectIteration("late", [1], sample_last=True, deadline=time.monotonic() + 0.05)
    reply = worker.submit_iteration(late)
    with pytest.raises(DeadlineExceededError):
        late.outcome()  # the caller stops waiting at its deadline, the worker still holds it
    release.set()
    assert isinstance(reply.exception(timeout=WAIT_S), DeadlineExceededError)
    assert run(worker, "next", [2], sample_last=True).predicted is not None
    assert [request.session_id for call in runtime.calls for request in call] == ["next"]


def test_a_deadline_that_passes_wins_over_a_reply_that_came_meanwhile(runtime_factory,
                                                                    make_batch_handle):
    worker = make_batch_handle(runtime_factory())
    iteration = DirectIteration("s", [1], sample_last=True, deadline=time.monotonic() + 0.2)
    worker.submit_iteration(iteration).result(timeout=WAIT_S)
    iteration.deadline = time.monotonic() - 0.01  # as if the reply came after it
    with pytest.raises(DeadlineExceededError):
        iteration.outcome()


def test_an_iteration_cancelled_while_queued_is_answered_without_running(
    runtime_factory, make_batch_handle, blocked_worker
):
    runtime = runtime_factory()
    worker = make_batch_handle(runtime)
    _, release = blocked_worker(worker)
    cancelled = threading.Event()
    reply = worker.submit_iteration(DirectIteration("gone", [1], cancelled=cancelled))
    cancelled.set()
    release.set()
    assert isinstance(reply.exception(timeout=WAIT_S), RequestCancelledError)
    assert runtime.calls == []
