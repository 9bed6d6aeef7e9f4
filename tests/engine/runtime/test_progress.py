"""llama.cpp counts its computed graph nodes for us; a long call that computes is not hung."""

from __future__ import annotations

import threading

import pytest
from cache_helpers import N_UBATCH, open_runtime, tokens

from skippyd.engine.runtime import watch
from skippyd.engine.runtime.contract import IterationRequest, SamplingConfig
from skippyd.engine.runtime.watch import CallWatch

GREEDY = SamplingConfig(temperature=0.0)


def test_every_micro_batch_of_a_decode_counts_its_nodes(tiny_model_path):
    with open_runtime(tiny_model_path) as runtime:
        progress = runtime.compute_progress
        assert progress is not None, "this libc has unnamed semaphores"
        assert progress.count() == 0
        runtime.run_iteration(
            [IterationRequest("one", tokens(1, N_UBATCH), sampling=GREEDY, sample_last=True)])
        one_micro_batch = progress.count()
        assert one_micro_batch > 0
        # Four micro-batches in one call: the count restarts with the call and grows with
        # every graph llama.cpp computes inside it.
        runtime.run_iteration(
            [IterationRequest("four", tokens(2, 4 * N_UBATCH), sampling=GREEDY,
                              sample_last=True)])
        assert progress.count() >= 3 * one_micro_batch
        progress.reset()
        assert progress.count() == 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class SlowInner:
    """A model call that runs until released, computing as the test says."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def call_watched(self, call_watch: CallWatch) -> None:
        with call_watch:
            self.entered.set()
            assert self.release.wait(30)


def test_a_real_runtime_marks_its_calls_on_its_watch(tiny_model_path):
    with open_runtime(tiny_model_path) as runtime:
        seen: list[float] = []
        watched = CallWatch(fault="")
        runtime.watch = watched
        hook = lambda: (seen.append(watched.busy_for()), ())[1]  # noqa: E731
        runtime.set_compute_hook(hook)
        runtime.run_iteration(
            [IterationRequest("one", tokens(1, 4), sampling=GREEDY, sample_last=True)])
        assert len(seen) == 1 and seen[0] > 0.0  # inside the call
        assert watched.busy_for() == 0.0  # and idle after it


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(watch, "time", fake)
    return fake


def test_a_long_call_that_computes_is_busy_but_not_stalled(clock):
    inner, nodes = SlowInner(), [0]
    call_watch = CallWatch(progress=lambda: nodes[0], fault="")
    assert call_watch.stalled_for() == 0.0
    call = threading.Thread(target=inner.call_watched, args=(call_watch,))
    call.start()
    try:
        assert inner.entered.wait(30)
        for _ in range(10):  # ten minutes of prefill, a graph node now and then
            clock.now += 60.0
            nodes[0] += 500
            assert call_watch.stalled_for() == 0.0
        assert call_watch.busy_for() == pytest.approx(600.0)
        clock.now += 45.0  # then llama.cpp stops computing
        assert call_watch.stalled_for() == pytest.approx(45.0)
        nodes[0] += 1
        assert call_watch.stalled_for() == 0.0
    finally:
        inner.release.set()
        call.join(30)
    assert call_watch.stalled_for() == 0.0  # idle


def test_without_a_progress_source_the_length_of_the_call_counts(clock):
    inner = SlowInner()
    call_watch = CallWatch(fault="")
    call = threading.Thread(target=inner.call_watched, args=(call_watch,))
    call.start()
    try:
        assert inner.entered.wait(30)
        clock.now += 90.0
        assert call_watch.stalled_for() == pytest.approx(90.0)
    finally:
        inner.release.set()
        call.join(30)
