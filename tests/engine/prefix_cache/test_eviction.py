"""Which entries give way to the budgets (pure bookkeeping, no runtime)."""

from __future__ import annotations

from skippyd.engine.prefix_cache import EntryTable, PrefixCacheSettings
from skippyd.engine.prefix_cache.entries import INDEX_BYTES_PER_TOKEN, host_cost
from skippyd.engine.prefix_cache.eviction import count_victims, host_victims

SETTINGS = PrefixCacheSettings(max_entries=4, min_tokens=4, host_ram_bytes=1000)


def table_with(*token_lists: list[int], settings: PrefixCacheSettings = SETTINGS) -> EntryTable:
    table = EntryTable(settings)
    for lane, tokens in enumerate(token_lists):
        table.add_resident(tokens, lane)
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
    assert hot.lane is None
    assert table.match(list(range(8))).entry is table.entries["p1"]
    assert table.stats().evictions == 1
    assert table.stats().bytes_host == 10 + 10 * INDEX_BYTES_PER_TOKEN  # state + token index


def test_entries_are_found_by_lane_longest_first():
    table = table_with([1] * 8)
    longer = table.add_resident([1] * 20, 0)
    table.add_resident([2] * 8, 3)
    assert ids(table.in_lane(0)) == [longer.id, "p1"]
    assert table.covers([1] * 12, 0) is longer
    assert table.covers([1] * 12, 3) is None  # lane 3 holds other tokens
    assert table.covers([1] * 21, 0) is None


def test_a_longer_record_supersedes_prefixes_of_its_lane_and_host_copies_only():
    table = table_with([1] * 8, [1] * 8)  # the same tokens in lanes 0 and 1
    hosted = table.add_resident([1] * 6, 2)
    table.move_to_host(hosted, b"s")
    longer = table.add_resident([1] * 30, 0)
    assert ids(table.superseded(longer)) == ["p1", hosted.id]  # lane 1's copy stays
    table.entries["p1"].pins.add("r")
    assert ids(table.superseded(longer)) == [hosted.id]  # pinned entries stay


def test_the_entry_count_bound_drops_the_coldest_unpinned_entries():
    table = table_with([1] * 8, [2] * 8, [3] * 8, [4] * 8, [5] * 8)
    newest = table.entries["p5"]
    table.touch(table.entries["p1"])
    table.entries["p2"].pins.add("r")
    assert ids(count_victims(table, 3, keep=newest)) == ["p3", "p4"]
    assert count_victims(table, 5) == []


def test_the_host_budget_counts_states_and_their_token_index_exactly():
    settings = PrefixCacheSettings(max_entries=4, min_tokens=4,
                                   host_ram_bytes=host_cost(60, 60) + host_cost(30, 30))
    table = table_with([1] * 60, [2] * 30, settings=settings)
    first, second = table.entries["p1"], table.entries["p2"]
    table.move_to_host(first, b"a" * 60)
    table.move_to_host(second, b"b" * 30)
    table.touch(first)
    assert host_victims(table, 0) == []
    assert ids(host_victims(table, 20)) == ["p2"]  # the colder one
    assert ids(host_victims(table, host_cost(30, 30) + 1)) == ["p2", "p1"]
    assert host_victims(table, settings.host_ram_bytes + 1) is None
    first.pins.add("r")
    assert host_victims(table, host_cost(30, 30) + 1) is None  # the pinned one stays
