"""Component capacity planning: five scenarios of competing memory components."""

from __future__ import annotations

import pytest

from skippyd.engine.policy import (
    CapacityDemand,
    ComponentCapacitySnapshot,
    EvictableCacheEntry,
    PolicyInputError,
    plan_component_capacity,
)


def _snapshot(capacity, active, pinned, *entries):
    return ComponentCapacitySnapshot("kv-cells", capacity, active, pinned, entries)


def test_pinned_capacity_rejects_admission_with_deficit():
    snapshot = _snapshot(100, 60, 30, EvictableCacheEntry("spare", 10, 5, 1))
    plan = plan_component_capacity(snapshot, CapacityDemand(request_units=10,
                                                            minimum_free_units=5))
    assert not plan.admitted
    assert plan.victim_ids == ()
    assert plan.admission_deficit_units == 60 + 30 + 10 + 5 - 100 == 5
    assert plan.projected_free_units == 0


def test_cheap_density_is_evicted_before_old_expensive_entries():
    snapshot = _snapshot(
        100, 50, 0,
        EvictableCacheEntry("old-expensive", units=20, recompute_cost=200, last_used=1),
        EvictableCacheEntry("new-cheap", units=20, recompute_cost=20, last_used=90),
    )
    plan = plan_component_capacity(snapshot, CapacityDemand(request_units=20))
    # occupancy 50 + 20 + 40 = 110 > 100: 10 units must go, the cheap density goes first.
    assert plan.admitted
    assert plan.victim_ids == ("new-cheap",)
    assert (plan.required_eviction_units, plan.evicted_units) == (10, 20)
    assert plan.predicted_recompute_cost == 20
    assert plan.projected_free_units == 10


def test_equal_density_evicts_the_colder_large_entry_first():
    snapshot = _snapshot(
        100, 60, 0,
        EvictableCacheEntry("hot-small", units=5, recompute_cost=50, last_used=50),
        EvictableCacheEntry("cold-large", units=30, recompute_cost=300, last_used=10),
    )
    plan = plan_component_capacity(snapshot, CapacityDemand(request_units=10))
    assert plan.victim_ids == ("cold-large",)
    assert plan.evicted_units == 30


def test_target_watermark_forces_eviction_when_minimum_is_met():
    snapshot = _snapshot(100, 40, 0, EvictableCacheEntry("idle", 30, 30, 1))
    demand = CapacityDemand(request_units=10, minimum_free_units=5, target_free_units=30)
    plan = plan_component_capacity(snapshot, demand)
    # 80 used, 20 free >= minimum 5 but < target 30: evict to reach the watermark.
    assert plan.admitted
    assert plan.required_eviction_units == 10
    assert plan.victim_ids == ("idle",)
    assert plan.projected_free_units == 50


def test_no_eviction_when_target_is_already_met():
    snapshot = _snapshot(100, 20, 10, EvictableCacheEntry("idle", 10, 1, 1))
    plan = plan_component_capacity(snapshot, CapacityDemand(10, 5, 40))
    assert plan.admitted
    assert (plan.victim_ids, plan.required_eviction_units, plan.evicted_units) == ((), 0, 0)
    assert plan.projected_free_units == 50
    assert plan.admission_deficit_units == 0


def test_zero_unit_entries_are_never_victims_and_bad_input_is_typed():
    snapshot = _snapshot(10, 5, 0, EvictableCacheEntry("empty", 0, 0, 0),
                         EvictableCacheEntry("real", 5, 50, 5))
    plan = plan_component_capacity(snapshot, CapacityDemand(request_units=3))
    assert plan.victim_ids == ("real",)
    with pytest.raises(PolicyInputError, match="units"):
        EvictableCacheEntry("bad", -1, 0, 0)
