"""Runtime operations: closures run on the worker thread, in command order."""

from __future__ import annotations

import queue
import threading

import pytest

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




















def test_runtime_operations_see_the_effect_of_earlier_iterations(runtime_factory,
                                                                 make_handle):
    runtime = runtime_factory()
    worker = make_handle(runtime)
    worker.execute_iteration("s", [1, 2, 3])
    assert worker.execute_runtime("count", lambda rt: rt.session_token_count("s")) == 3
