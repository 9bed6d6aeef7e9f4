"""Which entries give way (pure bookkeeping, no runtime)."""

from __future__ import annotations

import pytest

from skippyd.engine.prefix_cache import EntryTable, PrefixCacheSettings, Tier
from skippyd.engine.prefix_cache.entries import INDEX_BYTES_PER_TOKEN, host_cost
from skippyd.engine.prefix_cache.eviction import (
    budget_victims,
    host_victims,
    pressure_victims,
    recompute_cost,
    slot_victim,
)

SETTINGS = PrefixCacheSettings(max_entries=4, min_tokens=4, host_ram_bytes=1000)


def table_with(*token_lists: list[int], settings: PrefixCacheSettings = SETTINGS) -> EntryTable:
    table = EntryTable(settings, range(10, 14))
    for tokens in token_lists:
        table.add_resident(tokens)
    return table


def ids(entries) -> list[str]:
    return [entry.id for entry in entries]


def test_match_skips_short_prefixes_and_prefers_resident_then_warm_entries():
    table = table_with(list(range(10)), list(range(8)) + [50, 51])
    hot = table.entries["p2"]
    assert table.match(list(range(8)) + [99]).num_tokens == 8
    assert table.match(list(range(8)) + [99]).entry is hot  # touched last
    assert table.match([0, 1, 2, 77]).entry is None  # 3 tokens < min_tokens
    table.move_to_host(hot, b"x" * 10)
    assert table.match(list(range(8))).entry is table.entries["p1"]
    assert table.stats().evictions == 1
    assert table.stats().bytes_host == 10 + 10 * INDEX_BYTES_PER_TOKEN  # state + token index


def test_pressure_evicts_cheap_then_cold_entries_and_never_only_shared_cells():
    table = table_with([1] * 4 + [2] * 60, [3] * 64, [4] * 64)
    deep = table.add_resident([5] * 400)
    table.touch(table.entries["p2"])  # p1 is now the coldest 64-token entry
    lane = [[4] * 64]  # a lane holds p3's cells: evicting p3 frees nothing
    # 64 lane cells + 592 exclusive entry cells + 64 needed: 20 over a 700-cell pool.
    victims = pressure_victims(table, needed_tokens=64, pool_tokens=700, lane_histories=lane)
    assert ids(victims) == ["p1"]
    victims = pressure_victims(table, needed_tokens=200, pool_tokens=700, lane_histories=lane)
    assert ids(victims) == ["p1", "p2", deep.id]
    # Deeper tokens attend to more context: the same cells cost more to rebuild.
    assert recompute_cost(64, 400) > recompute_cost(64, 64)


def test_pinned_entries_go_last_and_only_when_nothing_else_frees_cells():
    table = table_with([1] * 32, [2] * 32)
    table.entries["p1"].pins.add("waiting-request")
    assert ids(pressure_victims(table, 10, 100, [])) == ["p2"]
    table.remove(table.entries["p2"])
    assert ids(pressure_victims(table, 10, 100, [])) == ["p1"]
    assert pressure_victims(table, 10, 100, [[1] * 32]) == []  # its cells are shared


def test_a_new_record_takes_the_slot_of_an_entry_whose_cells_are_all_shared():
    table = table_with([1] * 32, [2] * 32, [3] * 32, [4] * 32)
    assert not table.has_free_slot()
    table.touch(table.entries["p1"])
    assert slot_victim(table, [[2] * 32]).id == "p2"  # free to drop although warmer
    assert slot_victim(table, []).id == "p2"  # otherwise the coldest
    for entry in table.resident():
        entry.pins.add("r")
    assert slot_victim(table, []) is None


def test_resident_byte_budget_and_host_budget():
    # The host budget holds both states and their token index, exactly.
    settings = PrefixCacheSettings(max_entries=4, min_tokens=4, max_bytes=100 * 10,
                                   host_ram_bytes=host_cost(60, 60) + host_cost(30, 30))
    table = table_with([1] * 60, [2] * 30, settings=settings)
    table.kv_bytes_per_token = 10
    # 90 + 40 > 100 tokens: the shallower entry is cheaper per cell to rebuild.
    assert ids(budget_victims(table, 40)) == ["p2"]
    assert budget_victims(table, 10) == []
    table.entries["p1"].pins.add("r")
    table.entries["p2"].pins.add("r")
    assert budget_victims(table, 40) is None
    first, second = table.entries["p1"], table.entries["p2"]
    table.move_to_host(first, b"a" * 60)
    table.move_to_host(second, b"b" * 30)
    first.pins.clear()
    second.pins.clear()
    table.touch(first)
    assert host_victims(table, 0) == []
    assert ids(host_victims(table, 20)) == ["p2"]  # the colder one
    assert ids(host_victims(table, host_cost(30, 30) + 1)) == ["p2", "p1"]
    assert host_victims(table, settings.host_ram_bytes + 1) is None


def test_add_resident_without_a_slot_is_an_error():
    table = table_with([1] * 8, [2] * 8, [3] * 8, [4] * 8)
    with pytest.raises(RuntimeError, match="no free prefix-cache slot"):
        table.add_resident([5] * 8)
    assert table.entries["p1"].tier is Tier.RESIDENT
