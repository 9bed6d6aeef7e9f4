"""Cache-aware ordering: prefix groups, cache value, aging and the order's stability."""

from __future__ import annotations

import sys

from skippyd.engine.policy import (
    CacheAffinity,
    CacheAwareCandidate,
    StageCacheAffinity,
    order_cache_aware_candidates,
    waiting_prefix_dfs_order,
)


def _affinity(saved_cost: int) -> CacheAffinity:
    if saved_cost == 0:
        return CacheAffinity()
    return CacheAffinity.from_stage(StageCacheAffinity(0, saved_cost, 1))


def _candidate(index, *, cost=0, prompt=(1,), turn=0, order=None):
    return CacheAwareCandidate(
        index=index, affinity=_affinity(cost), prompt_tokens=list(prompt),
        enqueued_turn=turn, order=index if order is None else order,
    )


def test_cache_value_orders_candidates():
    candidates = [_candidate(0, cost=0), _candidate(1, cost=100)]
    assert order_cache_aware_candidates(candidates, 0, 10, True) == [1, 0]


def test_aging_eventually_promotes_a_cold_request():
    cold = _candidate(0, cost=0, turn=0, prompt=[5])
    hot = _candidate(1, cost=100, turn=11, prompt=[6])
    # At turn 11 the cold request has 11 * 10 = 110 credit against the fresh hot one's 100.
    assert order_cache_aware_candidates([cold, hot], 11, 10, True) == [0, 1]
    assert order_cache_aware_candidates([cold, hot], 9, 10, True) == [1, 0]


def test_dfs_weight_groups_the_heaviest_equal_score_prefix_subtree():
    candidates = [
        _candidate(0, prompt=[9, 9, 9]),
        _candidate(1, prompt=[1, 2, 3]),
        _candidate(2, prompt=[1, 2, 4]),
    ]
    assert order_cache_aware_candidates(candidates, 0, 10, True) == [1, 2, 0]


def test_disabling_prefix_grouping_restores_enqueue_order():
    candidates = [
        _candidate(0, prompt=[9, 9, 9]),
        _candidate(1, prompt=[1, 2, 3]),
        _candidate(2, prompt=[1, 2, 4]),
    ]
    assert order_cache_aware_candidates(candidates, 0, 10, False) == [0, 1, 2]


def test_materialized_cache_value_precedes_waiting_prefix_weight():
    candidates = [
        _candidate(0, prompt=[9, 9, 9], cost=1),
        _candidate(1, prompt=[1, 2, 3]),
        _candidate(2, prompt=[1, 2, 4]),
    ]
    assert order_cache_aware_candidates(candidates, 0, 10, True) == [0, 1, 2]


def test_long_common_prefix_does_not_drive_recursion_depth():
    shared = list(range(100_000))
    candidates = [
        _candidate(0, prompt=[7, 7]),
        _candidate(1, prompt=[*shared, 1, 2]),
        _candidate(2, prompt=[*shared, 1, 3]),
        _candidate(3, prompt=[*shared, 2]),
    ]
    assert sys.getrecursionlimit() < 100_000
    # The 3-member shared subtree first; inside it the heavier [.., 1] branch.
    assert order_cache_aware_candidates(candidates, 0, 10, True) == [1, 2, 3, 0]


def test_nested_prompt_chain_deeper_than_the_recursion_limit():
    depth = sys.getrecursionlimit() + 100
    prompts = [[0] * length for length in range(1, depth + 1)]
    order = waiting_prefix_dfs_order(prompts, range(depth))
    # A prompt that is a strict prefix of others comes after the group that extends it.
    assert order == list(range(depth - 1, -1, -1))


def test_dfs_ties_break_by_earliest_member_then_token():
    prompts = [[5, 1], [3, 1], [5, 2], [3, 2], [4]]
    # Two 2-member subtrees: token 5's earliest member (order 0) beats token 3's (order 1).
    assert waiting_prefix_dfs_order(prompts, [0, 1, 2, 3, 4]) == [0, 2, 1, 3, 4]
    # Same sizes and same earliest order cannot happen; equal prompts keep enqueue order.
    assert waiting_prefix_dfs_order([[1, 2], [1, 2], [1]], [2, 1, 0]) == [1, 0, 2]


def test_restore_cost_is_subtracted_per_stage_and_never_negative():
    affinity = CacheAffinity((
        StageCacheAffinity(0, matched_tokens=10, prefill_cost_per_token=5, restore_cost=80),
        StageCacheAffinity(1, matched_tokens=10, prefill_cost_per_token=5, restore_cost=20),
    ))
    assert affinity.estimated_saved_cost() == 0 + 30
    assert affinity.matched_tokens() == 20
    assert CacheAffinity().estimated_saved_cost() == 0
