"""Which cache entries give way, chosen with the capacity-planning helper.

Entries are evicted cheapest recompute cost per unit first, then colder first
(:func:`~skippyd.engine.policy.plan_component_capacity`). A unit is a KV cell. Cells
copied with ``llama_memory_seq_cp`` are shared, so evicting an entry frees only the cells
no lane and no other entry holds: its *exclusive* cells, estimated from token overlap
(a lane or entry holding the same leading tokens is assumed to share them, which holds
for everything the cache itself copied). Pure functions over an :class:`EntryTable`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from skippyd.engine.policy import (
    CapacityDemand,
    ComponentCapacitySnapshot,
    EvictableCacheEntry,
    plan_component_capacity,
)
from skippyd.engine.prefix_cache.entries import CacheEntry, EntryTable
from skippyd.engine.prefix_cache.radix import common_prefix_length
from skippyd.engine.prefix_cache.settings import PREFILL_COST_PER_TOKEN

logger = logging.getLogger(__name__)

#: Name of the KV component in capacity plans (the scheduler's own name for it).
KV_COMPONENT = "kv-cells"
#: Depth at which attention has doubled the modelled cost of computing one token.
ATTENTION_COST_SPAN_TOKENS = 1024


def recompute_cost(units: int, depth: int) -> int:
    """Modelled cost of recomputing the last ``units`` tokens of a ``depth``-token prefix.

    Deeper tokens attend to more context, so the same number of cells costs more to
    rebuild at the end of a long prefix than at the end of a short one.
    """
    mid_depth = max(0, depth - units // 2)
    return units * PREFILL_COST_PER_TOKEN * (ATTENTION_COST_SPAN_TOKENS + mid_depth) \
        // ATTENTION_COST_SPAN_TOKENS


def exclusive_units(entry: CacheEntry, holders: Sequence[Sequence[int]]) -> int:
    """Cells only ``entry`` holds: its tokens beyond its longest overlap with ``holders``."""
    shared = max((common_prefix_length(entry.tokens, tokens) for tokens in holders), default=0)
    return entry.num_tokens - min(shared, entry.num_tokens)


def eviction_order(candidates: Sequence[EvictableCacheEntry]) -> list[str]:
    """Ids of every candidate with units, in the planner's eviction order."""
    total = sum(candidate.units for candidate in candidates)
    snapshot = ComponentCapacitySnapshot(KV_COMPONENT, total, 0, 0, tuple(candidates))
    return list(plan_component_capacity(snapshot, CapacityDemand(0, 0, total)).victim_ids)


def _candidates(entries: Sequence[CacheEntry], units: dict[str, int],
                pad: int = 0) -> list[EvictableCacheEntry]:
    return [EvictableCacheEntry(entry.id, units[entry.id] + pad,
                                recompute_cost(units[entry.id], entry.num_tokens),
                                entry.last_used)
            for entry in entries]


def _resident_units(table: EntryTable, lane_histories: Sequence[Sequence[int]]) -> dict[str, int]:
    resident = table.resident()
    units = {}
    for entry in resident:
        others = [other.tokens for other in resident if other is not entry]
        units[entry.id] = exclusive_units(entry, [*lane_histories, *others])
    return units


def pressure_victims(
    table: EntryTable,
    needed_tokens: int,
    pool_tokens: int,
    lane_histories: Sequence[Sequence[int]],
) -> list[CacheEntry]:
    """Resident entries to evict so ``needed_tokens`` more cells fit in the pool.

    Unpinned entries go first, by the capacity plan; when the plan sees no need (the
    estimate is loose: llama.cpp just said there is no room) the first entry in its
    order goes. Pinned entries, whose holders wait or were preempted, go last, one at a
    time: a waiting request recomputes rather than an active one being preempted.

    Returns:
        Victims in eviction order; empty when no entry would free a cell.
    """
    units = _resident_units(table, lane_histories)
    resident = table.resident()
    unpinned = [entry for entry in resident if not entry.pins]
    pinned_units = sum(units[entry.id] for entry in resident if entry.pins)
    active_units = min(pool_tokens, sum(len(history) for history in lane_histories))
    snapshot = ComponentCapacitySnapshot(KV_COMPONENT, pool_tokens, active_units,
                                         min(pinned_units, pool_tokens - active_units),
                                         tuple(_candidates(unpinned, units)))
    plan = plan_component_capacity(snapshot, CapacityDemand(needed_tokens, 0, needed_tokens))
    ids = list(plan.victim_ids) if plan.admitted else []
    if not ids:
        ids = eviction_order(_candidates(unpinned, units))[:1]
    if not ids:
        pinned = [entry for entry in resident if entry.pins]
        ids = eviction_order(_candidates(pinned, units))[:1]
    return [table.entries[entry_id] for entry_id in ids]


def slot_victim(table: EntryTable, lane_histories: Sequence[Sequence[int]]) -> CacheEntry | None:
    """The unpinned resident entry to give its slot up for a new record, if any.

    Entries whose cells are all shared cost nothing to drop, so they go first.
    """
    units = _resident_units(table, lane_histories)
    unpinned = [entry for entry in table.resident() if not entry.pins]
    order = eviction_order(_candidates(unpinned, units, pad=1))
    return table.entries[order[0]] if order else None


def budget_victims(table: EntryTable, new_tokens: int) -> list[CacheEntry] | None:
    """Unpinned resident entries to evict so a ``new_tokens`` entry fits ``max_bytes``.

    Returns:
        The victims (maybe none), or None when the entry cannot fit at all.
    """
    per_token = table.kv_bytes_per_token
    if table.settings.max_bytes <= 0 or per_token <= 0:
        return []
    budget_units = table.settings.max_bytes // per_token
    resident = table.resident()
    units = {entry.id: entry.num_tokens for entry in resident}
    pinned = sum(entry.num_tokens for entry in resident if entry.pins)
    evictable = _candidates([entry for entry in resident if not entry.pins], units)
    snapshot = ComponentCapacitySnapshot(KV_COMPONENT, budget_units, 0, pinned, tuple(evictable))
    plan = plan_component_capacity(snapshot, CapacityDemand(new_tokens))
    if not plan.admitted:
        return None
    return [table.entries[entry_id] for entry_id in plan.victim_ids]


def host_victims(table: EntryTable, new_bytes: int) -> list[CacheEntry] | None:
    """Unpinned host entries to drop, coldest first, so ``new_bytes`` fit the host budget.

    ``new_bytes`` is the incoming entry's whole host cost (see ``host_cost``).

    Returns:
        The victims (maybe none), or None when the state cannot fit at all.
    """
    budget = table.settings.host_ram_bytes
    hosted = table.host()
    pinned_bytes = sum(entry.host_bytes for entry in hosted if entry.pins)
    if pinned_bytes + new_bytes > budget:
        return None
    used = sum(entry.host_bytes for entry in hosted)
    victims = []
    for entry in sorted((e for e in hosted if not e.pins), key=lambda e: e.last_used):
        if used + new_bytes <= budget:
            break
        victims.append(entry)
        used -= entry.host_bytes
    return victims
