"""Wait hooks: what the worker runs before it waits, for consumers that batch wake-ups."""

from __future__ import annotations

import logging
import os

import pytest
from fake_runtime import FakeRuntime
from worker_support import barrier, generate

from skippyd.engine.worker.wait_hooks import WaitHooks


def test_a_failing_hook_is_logged_and_the_others_still_run(caplog) -> None:
    hooks = WaitHooks()
    ran: list[str] = []

    def broken() -> None:
        raise RuntimeError("consumer bug")

    hooks.add(broken)
    hooks.add(lambda: ran.append("second"))
    with caplog.at_level(logging.ERROR):
        hooks.run()
    assert ran == ["second"]
    assert "worker wait hook failed" in caplog.text
    hooks.remove(broken)
    hooks.remove(broken)  # idempotent
    hooks.run()
    assert ran == ["second", "second"]


def test_without_a_runtime_hook_the_worker_runs_them_before_each_runtime_call(make_handle):
    runtime = FakeRuntime()
    worker = make_handle(runtime)
    calls_at_hook: list[int] = []
    worker.add_wait_hook(lambda: calls_at_hook.append(len(runtime.calls)))
    generate(worker, [1, 2, 3], 4)
    barrier(worker)
    assert set(range(len(runtime.calls))) <= set(calls_at_hook)
    assert calls_at_hook[-1] == len(runtime.calls)  # and once more before it went idle


def test_hooks_hand_back_eventfds_and_run_and_signal_signals_them(caplog) -> None:
    hooks = WaitHooks()
    fd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        hooks.add(lambda: fd)
        hooks.add(lambda: None)
        hooks.add(lambda: True)  # not an eventfd: logged, never written to
        with caplog.at_level(logging.ERROR):
            assert hooks.run() == (fd,)
        assert "not an eventfd" in caplog.text
        with pytest.raises(BlockingIOError):
            os.eventfd_read(fd)  # run() leaves the signalling to its caller
        hooks.run_and_signal()
        assert os.eventfd_read(fd) == 1
    finally:
        os.close(fd)
