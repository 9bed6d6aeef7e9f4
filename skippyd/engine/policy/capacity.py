"""Capacity planning for one memory component: what to evict to admit a request.

Not used by the scheduler itself; cache code asks it which evictable entries to drop so
that a request fits and a free-space watermark is kept.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

from skippyd.engine.policy.input_errors import PolicyInputError, checked_count

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EvictableCacheEntry:
    """A cached item that may be dropped, with what re-computing it would cost."""

    id: str
    units: int
    recompute_cost: int
    last_used: int
    """Recency stamp; smaller is colder."""

    def __post_init__(self) -> None:
        for name in ("units", "recompute_cost", "last_used"):
            checked_count(getattr(self, name), f"EvictableCacheEntry.{name}")


@dataclass(frozen=True, slots=True)
class ComponentCapacitySnapshot:
    """Occupancy of one component at planning time."""

    component: str
    capacity_units: int
    active_units: int
    """Held by running sequences; never evicted."""
    pinned_cache_units: int
    """Cache the planner must keep."""
    evictable_entries: tuple[EvictableCacheEntry, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("capacity_units", "active_units", "pinned_cache_units"):
            checked_count(getattr(self, name), f"ComponentCapacitySnapshot.{name}")
        entries = tuple(self.evictable_entries)
        if not all(isinstance(entry, EvictableCacheEntry) for entry in entries):
            raise PolicyInputError("evictable_entries must hold EvictableCacheEntry values")
        object.__setattr__(self, "evictable_entries", entries)


@dataclass(frozen=True, slots=True)
class CapacityDemand:
    """What the caller wants to fit, and how much room to leave."""

    request_units: int
    minimum_free_units: int = 0
    """Free space required for admission."""
    target_free_units: int = 0
    """Free space the planner evicts towards when admission is possible."""

    def __post_init__(self) -> None:
        for name in ("request_units", "minimum_free_units", "target_free_units"):
            checked_count(getattr(self, name), f"CapacityDemand.{name}")


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """The planner's verdict."""

    component: str
    admitted: bool
    victim_ids: tuple[str, ...]
    """Entries to evict, in eviction order."""
    required_eviction_units: int
    evicted_units: int
    predicted_recompute_cost: int
    """Sum of the victims' recompute costs."""
    projected_free_units: int
    admission_deficit_units: int
    """How far protected use exceeds capacity when not admitted; 0 otherwise."""


def plan_component_capacity(
    snapshot: ComponentCapacitySnapshot, demand: CapacityDemand
) -> CapacityPlan:
    """Choose evictions so ``demand`` fits in ``snapshot``.

    Active, pinned and requested units are protected. If they plus the minimum free space
    exceed capacity, nothing is evicted and the request is refused with its deficit.
    Otherwise the cheapest recompute cost per unit is evicted first (then colder, then
    cheaper, then by id) until the target free space is reached.

    Args:
        snapshot: Current occupancy of the component.
        demand: Request size and free-space watermarks.

    Returns:
        The plan; nothing is mutated.
    """
    capacity = snapshot.capacity_units
    min_free = min(demand.minimum_free_units, capacity)
    target_free = min(max(demand.target_free_units, min_free), capacity)
    protected = snapshot.active_units + snapshot.pinned_cache_units + demand.request_units
    if protected + min_free > capacity:
        return CapacityPlan(
            component=snapshot.component, admitted=False, victim_ids=(),
            required_eviction_units=0, evicted_units=0, predicted_recompute_cost=0,
            projected_free_units=max(0, capacity - protected),
            admission_deficit_units=protected + min_free - capacity,
        )
    occupancy = protected + sum(entry.units for entry in snapshot.evictable_entries)
    eviction_target = max(0, occupancy + target_free - capacity)
    victims: list[EvictableCacheEntry] = []
    evicted = 0
    for entry in sorted(snapshot.evictable_entries, key=functools.cmp_to_key(_eviction_cmp)):
        if evicted >= eviction_target:
            break
        if entry.units == 0:
            continue
        victims.append(entry)
        evicted += entry.units
    return CapacityPlan(
        component=snapshot.component, admitted=True,
        victim_ids=tuple(entry.id for entry in victims),
        required_eviction_units=eviction_target, evicted_units=evicted,
        predicted_recompute_cost=sum(entry.recompute_cost for entry in victims),
        projected_free_units=max(0, capacity - (occupancy - evicted)),
        admission_deficit_units=0,
    )


def _eviction_cmp(left: EvictableCacheEntry, right: EvictableCacheEntry) -> int:
    # Cost density compared by cross-multiplication (units floored at 1): exact, no floats.
    left_density = left.recompute_cost * max(right.units, 1)
    right_density = right.recompute_cost * max(left.units, 1)
    left_key = (left_density, left.last_used, left.recompute_cost, left.id)
    right_key = (right_density, right.last_used, right.recompute_cost, right.id)
    return (left_key > right_key) - (left_key < right_key)
