"""Per-thread CPU accounting the side-by-side benchmark reports per output token."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from skippyd.bench.process import cpu_per_token, thread_cpu_seconds

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux_only
def test_thread_cpu_seconds_follows_the_calling_thread():
    me = threading.get_native_id()
    before = thread_cpu_seconds(os.getpid())
    assert me in before
    deadline = time.monotonic() + 30.0
    while True:  # burn CPU until the kernel's tick accounting shows it
        sum(range(100_000))
        now = thread_cpu_seconds(os.getpid())
        if now[me] >= before[me] + 0.05:
            break
        assert time.monotonic() < deadline, "the thread's CPU time never grew"
    assert all(seconds >= 0.0 for seconds in now.values())


def test_thread_cpu_seconds_of_a_process_that_is_gone_is_empty():
    assert thread_cpu_seconds(2**22 + 12345) == {}


def test_cpu_per_token_splits_busy_threads_from_the_rest():
    before = {1: 10.0, 2: 10.0, 3: 1.0}
    after = {1: 19.0, 2: 18.0, 3: 1.5, 4: 0.5}  # thread 4 started during the run
    figures = cpu_per_token(before, after, wall_s=10.0, tokens=1000)
    assert figures["cpu_busy_ms_per_token"] == pytest.approx((9.0 + 8.0) / 1000 * 1000)
    assert figures["cpu_rest_ms_per_token"] == pytest.approx((0.5 + 0.5) / 1000 * 1000)


@pytest.mark.parametrize("after, wall_s, tokens", [({}, 1.0, 10), ({1: 2.0}, 1.0, 0),
                                                   ({1: 2.0}, 0.0, 10)])
def test_cpu_per_token_is_empty_without_figures_to_divide(after, wall_s, tokens):
    assert cpu_per_token({1: 1.0}, after, wall_s, tokens) == {}
