"""Runtime operations, cache-aware operations and the wave gates."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from fake_runtime import wait_until

from skippyd.engine.policy import CacheAffinity, StageCacheAffinity
from skippyd.engine.worker.cache_runtime import CachePayload, ContextState, RuntimeOperation
from skippyd.engine.worker.commands import (
    CacheAwareRuntimeCommand,
    CancellationToken,
    DeadlineExceededError,
    RequestCancelledError,
)
from skippyd.engine.worker.telemetry import SCHEDULER_RUNTIME_OPERATION

WAIT_S = 5.0


def in_thread(fn, *args, **kwargs) -> queue.SimpleQueue:
    """Run a blocking call on a helper thread; its result or exception lands in the queue."""
    results: queue.SimpleQueue = queue.SimpleQueue()

    def target() -> None:
        try:
            results.put(fn(*args, **kwargs))
        except Exception as exc:
            results.put(exc)

    threading.Thread(target=target, daemon=True).start()
    return results


def test_feature_runtime_operations_execute_on_the_worker_thread(runtime_factory,
                                                                    make_handle):
    worker = make_handle(runtime_factory(lane_count=3))
    seen_threads = []

    def lanes(runtime) -> int:
        seen_threads.append(threading.current_thread().name)
        return runtime.lane_count

    outcome = worker.execute_runtime_timed("lanes", lanes)
    assert outcome.value == 3
    assert outcome.queue_wait_ms >= 0 and outcome.run_ms >= 0
    assert seen_threads == ["skippy-iteration-scheduler"]
    assert worker.execute_runtime("lanes", lambda runtime: runtime.lane_count) == 3


def test_runtime_operation_errors_reach_the_caller_only(runtime_factory, make_handle):
    worker = make_handle(runtime_factory())

    def broken(_runtime) -> None:
        raise KeyError("missing page")

    with pytest.raises(KeyError, match="missing page"):
        worker.execute_runtime("broken", broken)
    assert worker.failure is None
    assert worker.execute_runtime("after", lambda _runtime: "alive") == "alive"


def test_detached_runtime_operation_returns_before_work_completes(runtime_factory,
                                                                  make_handle):
    worker = make_handle(runtime_factory())
    release, done = threading.Event(), threading.Event()

    def slow(_runtime) -> None:
        assert release.wait(WAIT_S)
        done.set()

    worker.execute_runtime_detached("checkpoint", slow)
    assert not done.is_set()  # returned while the operation is still blocked
    barrier = in_thread(worker.execute_runtime, "barrier", lambda _rt: done.is_set())
    release.set()
    assert barrier.get(timeout=WAIT_S) is True  # FIFO: the barrier ran after the detached op


def test_cancelled_cache_runtime_is_rejected_before_runtime_or_user_work(
    runtime_factory, make_handle, blocked_worker
):
    runtime = runtime_factory()
    worker = make_handle(runtime)
    ran = []

    def restore(rt, _context) -> None:
        ran.append(1)
        rt.ensure_session_active("restored")

    token = CancellationToken()
    token.cancel()
    with pytest.raises(RequestCancelledError, match="request-7 was cancelled"):
        worker.execute_cache_aware_runtime("restore", "request-7", restore,
                                              prompt_tokens=[1, 2], cancellation=token)

    _, release = blocked_worker(worker)
    queued_token = CancellationToken()
    result = in_thread(worker.execute_cache_aware_runtime, "restore", "request-7", restore,
                       prompt_tokens=[1, 2], cancellation=queued_token)
    queued_token.cancel()
    error = result.get(timeout=WAIT_S)
    assert isinstance(error, RequestCancelledError)
    assert "request-7 was cancelled" in error.message
    release.set()
    worker.execute_runtime("barrier", lambda _rt: None)
    worker.execute_runtime("barrier", lambda _rt: None)
    assert ran == []
    assert runtime.active_session_count() == 0
    assert worker.stats().cache_runtime_queue_depth == 0


def test_expired_cache_runtime_is_rejected_before_runtime_or_user_work(runtime_factory,
                                                                       make_handle):
    runtime = runtime_factory()
    worker = make_handle(runtime)
    ran = []
    with pytest.raises(DeadlineExceededError, match="request-8 exceeded its deadline"):
        worker.execute_cache_aware_runtime(
            "restore", "request-8", lambda _rt, _ctx: ran.append(1),
            prompt_tokens=[1], deadline=time.monotonic(),
        )
    with pytest.raises(DeadlineExceededError, match="request-8 exceeded its deadline"):
        worker.execute_runtime_bounded("restore", "request-8",
                                          lambda _rt, _ctx: ran.append(1),
                                          deadline=time.monotonic())
    worker.execute_runtime("barrier", lambda _rt: None)
    assert ran == []


def test_in_flight_cache_runtime_observes_cancellation_at_checkpoint(runtime_factory,
                                                                     make_handle):
    worker = make_handle(runtime_factory())
    token = CancellationToken()
    entered, proceed, finished = threading.Event(), threading.Event(), threading.Event()
    increments = []

    def restore(_runtime, context) -> None:
        try:
            increments.append(1)
            entered.set()
            assert proceed.wait(WAIT_S)
            context.ensure_active()  # checkpoint
            increments.append(2)
        finally:
            finished.set()

    result = in_thread(worker.execute_runtime_bounded, "restore", "request-9", restore,
                       cancellation=token)
    assert entered.wait(WAIT_S)
    token.cancel()
    proceed.set()
    error = result.get(timeout=WAIT_S)
    assert isinstance(error, RequestCancelledError)
    assert "request-9 was cancelled" in error.message
    assert finished.wait(WAIT_S)
    assert increments == [1]


def make_wave_worker(runtime_factory, make_worker):
    runtime = runtime_factory(lane_count=1)
    runtime.ensure_session_active("restored")  # the wave: 1 of 1 lanes
    worker = make_worker(runtime)
    worker.active_runtime_sessions = runtime.active_session_count()
    worker.direct_wave_full = True
    return runtime, worker


def cache_command(payload: CachePayload, ran: list) -> CacheAwareRuntimeCommand:
    operation = RuntimeOperation("restore", lambda _rt: ran.append(payload))
    return CacheAwareRuntimeCommand(operation, (1, 2, 3), 0, payload, None)


def test_full_direct_wave_suppresses_cache_runtime_while_direct_queue_is_temporarily_empty(
    runtime_factory, make_worker
):
    _, worker = make_wave_worker(runtime_factory, make_worker)
    ran: list = []
    worker.handle_command(cache_command(CachePayload.KV_RECURRENT, ran))
    worker.run_work_turn()
    assert ran == []
    assert len(worker.cache_queue) == 1


def test_resident_kv_does_not_engage_direct_wave_gate(runtime_factory, make_worker):
    _, worker = make_wave_worker(runtime_factory, make_worker)
    ran: list = []
    command = cache_command(CachePayload.RESIDENT_KV, ran)
    worker.handle_command(command)
    worker.run_work_turn()
    assert ran == [CachePayload.RESIDENT_KV]
    assert worker.cache_queue.is_empty()
    assert command.operation.reply.result(timeout=0).value is None


def test_wave_aware_restore_marks_a_saturated_wave(runtime_factory, make_worker):
    runtime = runtime_factory(lane_count=1)
    worker = make_worker(runtime)
    operation = RuntimeOperation("restore", lambda rt: rt.ensure_session_active("restored"))
    worker.handle_command(CacheAwareRuntimeCommand(operation, (1,), 0,
                                                   CachePayload.FULL_STATE, None))
    worker.run_work_turn()
    assert worker.active_runtime_sessions == 1
    assert worker.direct_wave_full is True
    runtime.drop_session("restored")
    worker.run_runtime_operation(RuntimeOperation("noop", lambda _rt: None), None)
    assert worker.direct_wave_full is False


def test_cache_operations_are_served_by_cache_value(runtime_factory, make_handle,
                                                    blocked_worker):
    worker = make_handle(runtime_factory())
    subscription = worker.telemetry.subscribe()
    _, release = blocked_worker(worker)
    order: list[str] = []
    hot = CacheAffinity.from_stage(StageCacheAffinity(0, 48, 1, 0, 3))
    results = [
        in_thread(worker.execute_cache_aware_runtime, "restore", name,
                  lambda _rt, ctx: order.append(ctx.operation_id), prompt_tokens=[i, 1],
                  refresh_affinity=refresh)
        for i, (name, refresh) in enumerate([("cold", CacheAffinity), ("hot", lambda: hot)])
    ]
    assert wait_until(lambda: worker.stats().command_queue_depth == 2)  # both queued
    release.set()
    for result in results:
        assert result.get(timeout=WAIT_S).value is None
    assert order == ["hot", "cold"]
    event = subscription.wait_for(
        lambda e: e.name == SCHEDULER_RUNTIME_OPERATION
        and e.attributes.get("skippy.scheduler.cache_operation_id") == "hot", WAIT_S)
    assert event.attributes["skippy.scheduler.cache_matched_tokens"] == 48
    assert event.attributes["skippy.scheduler.cache_epoch"] == 3
    assert event.attributes["skippy.scheduler.cache_operation_state"] == ContextState.ACTIVE.value


def test_runtime_operations_see_the_effect_of_earlier_iterations(runtime_factory,
                                                                 make_handle):
    runtime = runtime_factory()
    worker = make_handle(runtime)
    worker.execute_iteration("s", [1, 2, 3])
    assert worker.execute_runtime("count", lambda rt: rt.session_token_count("s")) == 3
