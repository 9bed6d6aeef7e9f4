"""The lab's radix scenarios, valued by a peek at the real radix tree.

``tests/bench/test_lab.py`` already checks radix-fcfs against radix-cache-aware with the
lab's stand-in index (``test_real_radix_affinity_prioritizes_the_high_value_prefix``,
``test_radix_scenarios_give_the_hot_request_lower_ttft``). Here the affinities come from
the prefix cache's own :class:`RadixTree` instead: the lab peeks the real radix tree
without touching its LRU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from skippyd.bench.lab_scenarios import apply_resident_radix_affinity
from skippyd.bench.lab_sim import RuntimeCostModel, SimRequest, simulate
from skippyd.engine.policy import CacheAffinity, SchedulerConfig
from skippyd.engine.prefix_cache import PrefixIndex

COST = RuntimeCostModel()


class RadixPeek:
    """The lab's prefix-index interface over a :class:`PrefixIndex` (stage = namespace)."""

    cache_epoch = 1

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def longest_match(self, stage_index: int, prompt: Sequence[int]) -> int:
        return self.index.match(f"stage-{stage_index}", prompt).num_tokens


def requests(cache_aware: bool, prompt_tokens: int, resident_tokens: int) -> list[SimRequest]:
    cold_and_hot = [
        SimRequest("a-cold", 0, prompt_tokens, 16, token_offset=10_000),
        SimRequest("b-cold", 0, prompt_tokens, 16, token_offset=20_000),
        SimRequest("c-hot", 0, prompt_tokens, 16, token_offset=0),
    ]
    index = PrefixIndex()
    index.tree("stage-0").insert(range(resident_tokens), "resident")
    hit = apply_resident_radix_affinity(RadixPeek(index), 0, COST.prefill_token_us, cold_and_hot)
    if not cache_aware:  # FCFS: same restores, no affinity
        hit = [dataclasses.replace(r, cache_affinity=CacheAffinity()) for r in hit]
    return hit


def test_cache_aware_ordering_serves_the_hot_request_first_with_no_queue_wait():
    config = SchedulerConfig(max_active_sequences=1, max_consecutive_prefill_iterations=1)
    fcfs = simulate(config, COST, requests(False, prompt_tokens=1024, resident_tokens=768))
    aware = simulate(config, COST, requests(True, prompt_tokens=1024, resident_tokens=768))
    assert aware.request("c-hot").ttft_us < fcfs.request("c-hot").ttft_us
    assert aware.request("c-hot").queue_wait_us == 0
    assert fcfs.request("c-hot").queue_wait_us > 0


def test_the_4096_token_scenarios_reproduce_the_same_result():
    config = SchedulerConfig(max_active_sequences=1, max_consecutive_prefill_iterations=1)
    fcfs = simulate(config, COST, requests(False, prompt_tokens=4096, resident_tokens=3072))
    aware = simulate(config, COST, requests(True, prompt_tokens=4096, resident_tokens=3072))
    assert aware.request("c-hot").ttft_us < fcfs.request("c-hot").ttft_us
    assert fcfs.makespan_us == aware.makespan_us  # only the order differs
