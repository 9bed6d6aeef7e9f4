"""Runtime operations: closures run on the worker thread, in command order."""

from __future__ import annotations

import threading

from worker_support import on_worker

from skippyd.engine.worker.direct_batch import DirectIteration

WAIT_S = 5.0


def test_runtime_operations_execute_on_the_worker_thread(runtime_factory, make_handle):
    worker = make_handle(runtime_factory(lane_count=3))
    seen_threads = []

    def lanes(runtime) -> int:
        seen_threads.append(threading.current_thread().name)
        return runtime.lane_count

    assert on_worker(worker, lanes) == 3
    assert seen_threads == ["skippyd-worker"]


def test_a_failing_runtime_operation_is_logged_and_the_worker_goes_on(
    runtime_factory, make_handle, caplog
):
    worker = make_handle(runtime_factory())

    def broken(_runtime) -> None:
        raise KeyError("missing page")

    worker.execute_runtime_detached("broken", broken)
    assert on_worker(worker, lambda _runtime: "alive") == "alive"
    assert worker.failure is None
    assert "runtime operation broken failed" in caplog.text
    assert worker.stats().num_runtime_operations >= 2


def test_detached_runtime_operation_returns_before_work_completes(runtime_factory,
                                                                  make_handle):
    worker = make_handle(runtime_factory())
    release, done = threading.Event(), threading.Event()

    def slow(_runtime) -> None:
        assert release.wait(WAIT_S)
        done.set()

    worker.execute_runtime_detached("checkpoint", slow)
    assert not done.is_set()  # returned while the operation is still blocked
    seen: list[bool] = []
    worker.execute_runtime_detached("after", lambda _rt: seen.append(done.is_set()))
    release.set()
    assert on_worker(worker, lambda _rt: seen) == [True]  # FIFO: ran after the slow one


def test_runtime_operations_see_the_effect_of_earlier_iterations(runtime_factory,
                                                                 make_batch_handle):
    runtime = runtime_factory()
    worker = make_batch_handle(runtime)
    worker.submit_iteration(DirectIteration("s", [1, 2, 3])).result(timeout=WAIT_S)
    assert on_worker(worker, lambda rt: rt.session_token_count("s")) == 3
