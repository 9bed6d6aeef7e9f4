"""The worker turn by turn: requests parked behind a leader's shared prefix."""

from __future__ import annotations

import queue

import pytest
from cache_helpers import GREEDY, SETTINGS, Collector, open_runtime, tokens

from skippyd.engine.prefix_cache import LivePrefixCache
from skippyd.engine.worker.commands import (
    CancelCommand,
    GenerationRequest,
    SubmitCommand,
)
from skippyd.engine.worker.settings import WorkerSettings
from skippyd.engine.worker.telemetry import TelemetryHub
from skippyd.engine.worker.thread_loop import WorkerLoop

SHARED = tokens(1, 150)


@pytest.fixture
def worker(tiny_model_path):
    """A worker core without its thread, one lane, over a runtime with cache slots."""
    runtime = open_runtime(tiny_model_path, lanes=1, ctx_size=512)
    settings = WorkerSettings.derive(runtime, queue_capacity=8)
    cache = LivePrefixCache(runtime, SETTINGS, namespace="tiny")
    core = WorkerLoop(runtime, settings, queue.Queue(), TelemetryHub(), cache)
    yield core
    runtime.close()


def submit(worker: WorkerLoop, req_id: str, prompt: list[int], max_tokens: int) -> Collector:
    collector = Collector()
    worker.handle_command(SubmitCommand(GenerationRequest(req_id, prompt, max_tokens, GREEDY),
                                        collector))
    return collector


def run_until(worker: WorkerLoop, done, max_turns: int = 200) -> None:
    for _ in range(max_turns):
        if done():
            return
        worker.run_work_turn()
    raise AssertionError("the condition did not hold within the turn limit")


def test_a_follower_waits_for_the_leader_then_restores_its_prefix(worker):
    blocker = submit(worker, "blocker", tokens(7, 20), 3)  # holds the only lane
    worker.run_work_turn()
    leader = submit(worker, "leader", SHARED + tokens(8, 10), 3)
    follower = submit(worker, "follower", SHARED + tokens(9, 10), 3)
    assert worker.planned.num_parked == 1  # the leader has no KV yet
    worker.publish_stats()
    assert worker.stats.num_waiting == 2
    run_until(worker, lambda: follower.done.is_set())
    assert len(follower.result()) == 3 and len(leader.result()) == 3 and blocker.done.is_set()
    cache = worker.planned.prefix_flow.cache
    assert cache.cached_prompt_tokens("follower") == len(SHARED)
    assert (cache.stats().hits, cache.stats().misses) == (1, 2)


def test_a_parked_request_can_be_cancelled_and_its_leader_goes_on(worker):
    submit(worker, "blocker", tokens(7, 20), 3)
    worker.run_work_turn()
    leader = submit(worker, "leader", SHARED + tokens(8, 10), 3)
    follower = submit(worker, "follower", SHARED + tokens(9, 10), 3)
    worker.handle_command(CancelCommand("follower"))
    worker.handle_command(CancelCommand("follower"))  # idempotent
    assert worker.planned.num_parked == 0 and "follower" not in worker.planned.requests
    run_until(worker, lambda: leader.done.is_set())
    assert len(leader.result()) == 3
    assert not follower.done.is_set() and follower.tokens == []  # a cancel sends nothing


def test_followers_of_a_cancelled_leader_are_routed_again(worker):
    submit(worker, "blocker", tokens(7, 20), 3)
    worker.run_work_turn()
    submit(worker, "leader", SHARED + tokens(8, 10), 3)
    follower = submit(worker, "follower", SHARED + tokens(9, 10), 3)
    worker.handle_command(CancelCommand("leader"))
    assert worker.planned.num_parked == 0  # nothing left to wait for: it queues cold
    run_until(worker, lambda: follower.done.is_set())
    assert len(follower.result()) == 3
    assert worker.planned.prefix_flow.cache.cached_prompt_tokens("follower") == 0
