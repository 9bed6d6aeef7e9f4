"""The live prefix cache on the real runtime (tiny model): record, lease, restore, tiers."""

from __future__ import annotations

import dataclasses

import pytest
from cache_helpers import SETTINGS, greedy_continue, open_runtime, prefill, tokens

from skippyd.engine.prefix_cache import PREFIX_CACHE_EVENT, LivePrefixCache, Tier
from skippyd.engine.worker.telemetry import TelemetryHub

PREFIX = tokens(1, 96)
OTHER = tokens(5, 96)
SUFFIX = tokens(2, 12)


def make_cache(runtime, **overrides) -> tuple[LivePrefixCache, TelemetryHub]:
    hub = TelemetryHub()
    settings = dataclasses.replace(SETTINGS, **overrides)
    return LivePrefixCache(runtime, settings, namespace="tiny", publish=hub.publish), hub


def record_from_lane(runtime, cache: LivePrefixCache, session: str, prompt: list[int]):
    runtime.ensure_session_active(session)
    prefill(runtime, session, prompt)
    entry = cache.record(session, len(prompt))
    runtime.drop_session(session)
    return entry


@pytest.fixture(scope="module")
def expected(tiny_model_path) -> list[int]:
    with open_runtime(tiny_model_path, slots=0) as fresh:
        prefill(fresh, "ref", PREFIX)
        return greedy_continue(fresh, "ref", SUFFIX, 8)


def test_a_hit_restores_the_prefix_and_reports_it(runtime, expected):
    cache, hub = make_cache(runtime)
    with hub.subscribe() as events:
        entry = record_from_lane(runtime, cache, "source", PREFIX)
        assert entry is not None and entry.tier is Tier.RESIDENT
        lease = cache.lease("req", PREFIX + SUFFIX)
        assert lease is not None and lease.tokens == tuple(PREFIX)
        assert entry.pins == {"req"}
        runtime.ensure_session_active("req")
        assert cache.restore("req", "req")
        assert greedy_continue(runtime, "req", SUFFIX, 8) == expected
        cache.release("req")
        assert entry.pins == set()
        names = [event.name for event in events.drain()]
    assert cache.cached_prompt_tokens("req") == len(PREFIX)
    assert cache.cached_prompt_tokens("unknown") == 0
    stats = cache.stats().as_dict()
    assert stats["hits"] == 1 and stats["misses"] == 0 and stats["matched_tokens"] == 96
    assert stats["bytes_resident"] > 0 and stats["hit_rate"] == 1.0
    assert set(names) == {PREFIX_CACHE_EVENT}


def test_a_fully_cached_prompt_still_computes_its_last_token(runtime):
    cache, _ = make_cache(runtime)
    record_from_lane(runtime, cache, "source", PREFIX)
    assert cache.lease("again", PREFIX) is not None
    assert cache.cached_prompt_tokens("again") == len(PREFIX) - 1  # the last token is computed
    assert cache.lease("short", PREFIX[:8] + SUFFIX) is None  # below min_tokens: a miss
    assert cache.stats().misses == 1


def test_an_entry_evicted_to_host_ram_restores_from_there(runtime, expected):
    cache, _ = make_cache(runtime, max_entries=1)
    first = record_from_lane(runtime, cache, "a", PREFIX)
    second = record_from_lane(runtime, cache, "b", OTHER)  # takes the only slot
    assert first.tier is Tier.HOST and second.tier is Tier.RESIDENT
    assert cache.stats().bytes_host > 0 and cache.stats().evictions == 1
    assert cache.lease("req", PREFIX + SUFFIX) is not None
    runtime.ensure_session_active("req")
    assert cache.restore("req", "req")
    assert first.tier is Tier.RESIDENT and second.tier is Tier.HOST  # promoted back
    assert greedy_continue(runtime, "req", SUFFIX, 8) == expected


def test_without_host_room_an_evicted_entry_is_gone(runtime):
    cache, _ = make_cache(runtime, max_entries=1, host_ram_bytes=1024)
    record_from_lane(runtime, cache, "a", PREFIX)
    record_from_lane(runtime, cache, "b", OTHER)
    assert cache.lease("req", PREFIX + SUFFIX) is None
    assert cache.stats().bytes_host == 0 and cache.stats().evictions == 1


def test_a_longer_record_supersedes_its_unpinned_prefix(runtime):
    cache, _ = make_cache(runtime)
    short = record_from_lane(runtime, cache, "a", PREFIX[:40])
    runtime.ensure_session_active("b")
    prefill(runtime, "b", PREFIX)
    long = cache.record("b", len(PREFIX))
    assert short.id not in cache.table.entries and long.id in cache.table.entries
    assert cache.record("b", 50) is long  # already covered: no new entry
    assert cache.stats().records == 2


def test_kv_pressure_evicts_only_entries_holding_cells_of_their_own(runtime):
    cache, _ = make_cache(runtime, host_tier=False)
    runtime.ensure_session_active("live")
    prefill(runtime, "live", PREFIX)
    cache.record("live", len(PREFIX))  # its cells are the live lane's: nothing to free
    assert not cache.relieve_kv_pressure(64)
    record_from_lane(runtime, cache, "gone", OTHER)
    assert cache.relieve_kv_pressure(64)
    assert cache.stats().entries_resident == 1 and cache.stats().evictions == 1
