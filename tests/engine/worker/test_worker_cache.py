"""The prefix cache in the worker (tiny model, real llama.cpp)."""

from __future__ import annotations

import dataclasses

from cache_helpers import SETTINGS, submit_all, tokens

from skippyd.engine.telemetry_events import StepFinished

SHARED = tokens(1, 200)
BURST = {f"r{i}": SHARED + tokens(10 + i, 6) for i in range(4)}


def prefill_tokens(events) -> int:
    return sum(event.payload.prefill_tokens for event in events
               if isinstance(event.payload, StepFinished))


def test_a_burst_sharing_a_prefix_prefills_it_once_with_the_same_output(make_stack):
    without, _ = make_stack(cache=False)
    expected = {req_id: c.result() for req_id, c in submit_all(without, BURST, 8).items()}
    worker, cache = make_stack()
    with worker.telemetry.subscribe(maxlen=4096) as events:
        collectors = submit_all(worker, BURST, 8)
        results = {req_id: c.result() for req_id, c in collectors.items()}
        computed = prefill_tokens(events.drain())
    assert results == expected
    stats = cache.stats()
    assert (stats.hits, stats.misses) == (3, 1)
    cached = sorted(c.cached_tokens for c in collectors.values())
    assert cached == [0, len(SHARED), len(SHARED), len(SHARED)]
    # The shared prefix was computed once: one whole prompt plus three suffixes.
    assert computed == len(SHARED) + 4 * 6
    assert worker.stats().num_preempted == 0


def test_the_next_turn_of_a_conversation_restores_the_whole_first_turn(make_stack):
    worker, cache = make_stack()
    first = SHARED + tokens(20, 10)
    [turn1] = submit_all(worker, {"turn-1": first}, 8).values()
    reply = turn1.result()
    second = first + reply + tokens(21, 5)
    [turn2] = submit_all(worker, {"turn-2": second}, 4).values()
    turn2.result()
    # The last reply token was sampled but never decoded: the KV ends one before it.
    assert turn2.cached_tokens == len(first) + len(reply) - 1
    without, _ = make_stack(cache=False)
    [reference] = submit_all(without, {"turn-2": second}, 4).values()
    assert turn2.result() == reference.result()


def test_a_reused_lane_moves_its_prefix_to_host_ram_and_nothing_is_preempted(make_stack):
    settings = dataclasses.replace(SETTINGS, max_entries=8)
    worker, cache = make_stack(settings=settings, ctx_size=1024)
    for seed in range(4):  # one after another: each takes lane 0, the lowest idle lane
        [done] = submit_all(worker, {f"fill-{seed}": tokens(30 + seed, 220)}, 4).values()
        done.result()
    stats = cache.stats()
    assert (stats.entries_resident, stats.entries_host, stats.evictions) == (1, 3, 3)
    long_requests = {f"long-{i}": tokens(40 + i, 100) for i in range(4)}  # 4 lanes
    collectors = submit_all(worker, long_requests, 120)
    assert all(len(c.result()) == 120 for c in collectors.values())
    assert worker.stats().num_preempted == 0  # lanes never compete for cells
    assert cache.stats().entries_host == 4 and cache.stats().bytes_host > 0
