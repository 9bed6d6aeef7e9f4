"""The worker turn by turn: requests parked behind a leader's shared prefix."""

from __future__ import annotations

import pytest
from cache_helpers import GREEDY, SETTINGS, Collector, open_runtime, tokens

from skippyd.engine.prefix_cache import LivePrefixCache
from skippyd.engine.worker.commands import CancelCommand
from skippyd.engine.worker.generation_events import GenerationRequest
from skippyd.engine.worker.record import GenerationStatus
from skippyd.engine.worker.worker_errors import InvalidRequestError, RequestCancelledError

SHARED = tokens(1, 150)


@pytest.fixture
def worker(tiny_model_path, make_worker):
    """A generation worker without its thread, one lane, over a runtime with cache slots."""
    runtime = open_runtime(tiny_model_path, lanes=1, ctx_size=512)
    cache = LivePrefixCache(runtime, SETTINGS, namespace="tiny")
    yield make_worker(runtime, prefix_cache=cache)
    runtime.close()


def submit(worker, req_id: str, prompt: list[int], max_tokens: int) -> Collector:
    collector = Collector()
    worker.submit(GenerationRequest(req_id, prompt, max_tokens, GREEDY), collector)
    return collector


def num_parked(worker) -> int:
    return sum(1 for gen in worker.generations.values() if gen.status is GenerationStatus.PARKED)


def run_until(worker, done, max_turns: int = 200) -> None:
    for _ in range(max_turns):
        if done():
            return
        worker.run_turn()
    raise AssertionError("the condition did not hold within the turn limit")


def test_a_follower_waits_for_the_leader_then_restores_its_prefix(worker):
    blocker = submit(worker, "blocker", tokens(7, 20), 3)  # holds the only lane
    worker.run_turn()
    leader = submit(worker, "leader", SHARED + tokens(8, 10), 3)
    follower = submit(worker, "follower", SHARED + tokens(9, 10), 3)
    assert num_parked(worker) == 1  # the leader has no KV yet
    worker.loop.publish_stats()
    assert worker.loop.stats.num_waiting == 2
    run_until(worker, lambda: follower.done.is_set())
    assert len(follower.result()) == 3 and len(leader.result()) == 3 and blocker.done.is_set()
    cache = worker.role.prefix.cache
    assert follower.cached_tokens == len(SHARED)
    assert (cache.stats().hits, cache.stats().misses) == (1, 2)


def test_a_parked_request_can_be_cancelled_and_its_leader_goes_on(worker):
    submit(worker, "blocker", tokens(7, 20), 3)
    worker.run_turn()
    leader = submit(worker, "leader", SHARED + tokens(8, 10), 3)
    follower = submit(worker, "follower", SHARED + tokens(9, 10), 3)
    worker.handle(CancelCommand("follower"))
    worker.handle(CancelCommand("follower"))  # idempotent
    assert num_parked(worker) == 0 and "follower" not in worker.generations
    assert isinstance(follower.error, RequestCancelledError) and follower.tokens == []
    run_until(worker, lambda: leader.done.is_set())
    assert len(leader.result()) == 3


def test_followers_of_a_cancelled_leader_are_routed_again(worker):
    submit(worker, "blocker", tokens(7, 20), 3)
    worker.run_turn()
    submit(worker, "leader", SHARED + tokens(8, 10), 3)
    follower = submit(worker, "follower", SHARED + tokens(9, 10), 3)
    worker.handle(CancelCommand("leader"))
    assert num_parked(worker) == 0  # nothing left to wait for: it queues cold
    run_until(worker, lambda: follower.done.is_set())
    assert len(follower.result()) == 3
    assert follower.cached_tokens == 0


def test_a_duplicate_id_never_replaces_a_parked_request(worker):
    submit(worker, "blocker", tokens(7, 20), 3)
    worker.run_turn()
    submit(worker, "leader", SHARED + tokens(8, 10), 3)
    follower = submit(worker, "follower", SHARED + tokens(9, 10), 3)
    parked = worker.generations["follower"]
    duplicate = submit(worker, "follower", tokens(4, 30), 3)
    assert isinstance(duplicate.error, InvalidRequestError)
    assert "already queued or active: follower" in str(duplicate.error)
    assert worker.generations["follower"] is parked and num_parked(worker) == 1
    run_until(worker, lambda: follower.done.is_set())
    assert len(follower.result()) == 3 and follower.cached_tokens == len(SHARED)
