"""CacheRuntimeQueue and the cache/direct wave gates."""

from __future__ import annotations

import pytest

from skippyd.engine.policy import CacheAffinity, StageCacheAffinity
from skippyd.engine.worker.cache_runtime import (
    CachePayload,
    CacheRuntimeQueue,
    cache_runtime_wave_enabled,
    should_coalesce_direct_iterations,
    should_fill_cache_runtime_wave,
    should_serve_cache_runtime,
    should_suppress_cache_runtime,
)


def affinity(matched: int, cost_per_token: int = 1, epoch: int = 0) -> CacheAffinity:
    return CacheAffinity.from_stage(StageCacheAffinity(
        stage_index=0, matched_tokens=matched, prefill_cost_per_token=cost_per_token,
        restore_cost=0, cache_epoch=epoch,
    ))


@pytest.mark.parametrize(("has_cache", "has_iteration", "last_cache", "expected"), [
    (True, True, False, True),
    (True, True, True, False),
    (True, False, True, True),
    (False, True, False, False),
    (False, False, False, False),
])
def test_cache_runtime_and_decode_work_alternate_without_starvation(
    has_cache, has_iteration, last_cache, expected
):
    assert should_serve_cache_runtime(has_cache, has_iteration, last_cache) is expected


def test_cache_fill_wave_fills_below_direct_batch_capacity():
    assert should_fill_cache_runtime_wave(True, True, 1, 4) is True


def test_cache_fill_wave_stops_at_direct_batch_capacity():
    assert should_fill_cache_runtime_wave(True, True, 4, 4) is False
    assert should_fill_cache_runtime_wave(True, True, 5, 4) is False


def test_cache_fill_wave_does_not_change_planned_only_work():
    assert should_fill_cache_runtime_wave(False, True, 1, 4) is False


def test_cache_fill_wave_does_not_run_without_cache_work():
    assert should_fill_cache_runtime_wave(True, False, 1, 4) is False


def test_cache_runtime_is_suppressed_at_full_direct_capacity():
    assert should_suppress_cache_runtime(True, True, 4, 4) is True
    assert should_suppress_cache_runtime(True, True, 3, 4) is False
    assert should_suppress_cache_runtime(False, True, 4, 4) is False


def test_cache_wave_gates_are_opt_in_by_payload():
    assert cache_runtime_wave_enabled(CachePayload.RESIDENT_KV) is False
    assert cache_runtime_wave_enabled(CachePayload.KV_RECURRENT) is True
    assert cache_runtime_wave_enabled(CachePayload.FULL_STATE) is True
    assert should_coalesce_direct_iterations(True, False) is False
    assert should_coalesce_direct_iterations(True, True) is True
    assert should_coalesce_direct_iterations(False, False) is True


def test_queue_wave_awareness_and_coalescing_are_payload_specific():
    queue: CacheRuntimeQueue[str] = CacheRuntimeQueue()
    queue.enqueue("resident", CacheAffinity(), [1, 2], payload=CachePayload.RESIDENT_KV)
    assert queue.has_wave_aware_operations() is False
    assert should_coalesce_direct_iterations(not queue.is_empty(),
                                             queue.has_wave_aware_operations()) is False
    queue.enqueue("recurrent", CacheAffinity(), [3, 4], payload=CachePayload.KV_RECURRENT)
    assert queue.has_wave_aware_operations() is True
    assert should_coalesce_direct_iterations(not queue.is_empty(),
                                             queue.has_wave_aware_operations()) is True


def test_queue_selects_the_longest_prefix_first():
    queue: CacheRuntimeQueue[str] = CacheRuntimeQueue()
    queue.enqueue("cold", CacheAffinity(), [1, 2, 3])
    queue.enqueue("hot", affinity(32), [4, 5, 6])
    operation, telemetry = queue.pop_next()
    assert operation == "hot"
    assert telemetry.matched_tokens == 32
    assert telemetry.stage_hits == 1
    assert queue.pop_next()[0] == "cold"
    assert queue.pop_next() is None


def test_queue_keeps_shared_waiting_prefixes_adjacent():
    queue: CacheRuntimeQueue[str] = CacheRuntimeQueue()
    queue.enqueue("unique", CacheAffinity(), [9, 9, 9])
    queue.enqueue("shared-a", CacheAffinity(), [1, 2, 3])
    queue.enqueue("shared-b", CacheAffinity(), [1, 2, 4])
    order = [queue.pop_next()[0] for _ in range(3)]
    assert order == ["shared-a", "shared-b", "unique"]


def test_stale_affinity_is_refreshed_before_selection():
    queue: CacheRuntimeQueue[str] = CacheRuntimeQueue()
    queue.enqueue("stale-hot", affinity(64, epoch=1), [1, 2],
                  refresh_affinity=lambda: CacheAffinity())
    queue.enqueue("fresh-hot", CacheAffinity(), [3, 4],
                  refresh_affinity=lambda: affinity(64, epoch=2))
    operation, telemetry = queue.pop_next()
    assert operation == "fresh-hot"
    assert telemetry.stale_affinity_fallback is True
    assert telemetry.cache_epoch == 2
    assert telemetry.matched_tokens == 64


def test_lazy_affinity_is_computed_once_without_reporting_staleness():
    calls = []

    def refresh() -> CacheAffinity:
        calls.append(1)
        return affinity(16, epoch=7)

    queue: CacheRuntimeQueue[str] = CacheRuntimeQueue()
    queue.enqueue_lazy("lazy", [1, 2, 3], 0, CachePayload.FULL_STATE, refresh)
    operation, telemetry = queue.pop_next()
    assert operation == "lazy"
    assert len(calls) == 1
    assert telemetry.stale_affinity_fallback is False
    assert telemetry.cache_epoch == 7
    assert telemetry.wave_aware is True


def test_aging_is_reported_in_turns_and_promotes_old_cold_work():
    queue: CacheRuntimeQueue[str] = CacheRuntimeQueue(aging_cost_per_turn=10)
    queue.enqueue("cold", CacheAffinity(), [1])
    for _ in range(11):
        queue.advance_turn()
    queue.enqueue("hot", affinity(100), [2])
    operation, telemetry = queue.pop_next()
    assert operation == "cold"  # 11 turns x 10 credit beats a saved cost of 100
    assert telemetry.age_turns == 11


def test_failing_affinity_refresh_keeps_the_operation_servable():
    def broken() -> CacheAffinity:
        raise OSError("cache index unavailable")

    queue: CacheRuntimeQueue[str] = CacheRuntimeQueue()
    queue.enqueue_lazy("op", [1], 0, CachePayload.RESIDENT_KV, broken)
    assert queue.pop_next()[0] == "op"
    assert queue.is_empty()
