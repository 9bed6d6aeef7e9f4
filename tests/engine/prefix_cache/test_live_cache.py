"""The live prefix cache on the real runtime (tiny model): record, lease, place, restore,
demote to host RAM."""

from __future__ import annotations

import dataclasses

import pytest
from cache_helpers import SETTINGS, greedy_continue, open_runtime, prefill, tokens

from skippyd.engine.prefix_cache import Lease, LivePrefixCache, Tier
from skippyd.engine.telemetry_events import PrefixCacheChanged
from skippyd.engine.worker.telemetry import TelemetryHub

PREFIX = tokens(1, 96)
OTHER = tokens(5, 96)
SUFFIX = tokens(2, 12)


class LeaseKeepingCache(LivePrefixCache):
    """The live cache, keeping each request's lease the way the worker's record does."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.leases: dict[str, Lease | None] = {}

    def lease(self, req_id, prompt):
        self.leases[req_id] = lease = super().lease(req_id, prompt)
        return lease


def make_cache(runtime, **overrides) -> tuple[LeaseKeepingCache, TelemetryHub]:
    hub = TelemetryHub()
    settings = dataclasses.replace(SETTINGS, **overrides)
    return LeaseKeepingCache(runtime, settings, namespace="tiny", publish=hub.publish), hub


def record_from_lane(runtime, cache: LivePrefixCache, session: str, prompt: list[int]):
    """Prefill ``prompt`` in a fresh session, record it, end the session (the lane keeps it)."""
    runtime.ensure_session_active(session)
    prefill(runtime, session, prompt)
    entry = cache.record(session, len(prompt))
    runtime.drop_session(session)
    return entry


def start(runtime, cache: LeaseKeepingCache, req: str):
    """Bind a request the way the worker does: placed by the cache, then its lease (if it
    holds one) restored."""
    lease = cache.leases.get(req)
    placement = cache.place(lease)
    runtime.ensure_session_active(req, lane=placement.lane, keep_tokens=placement.keep_tokens)
    return placement, lease is not None and cache.restore(lease, req)


@pytest.fixture(scope="module")
def expected(tiny_model_path) -> list[int]:
    with open_runtime(tiny_model_path) as fresh:
        prefill(fresh, "ref", PREFIX)
        return greedy_continue(fresh, "ref", SUFFIX, 8)


def test_a_hit_starts_in_the_entry_lane_without_a_copy(runtime, expected):
    cache, hub = make_cache(runtime)
    with hub.subscribe() as events:
        entry = record_from_lane(runtime, cache, "source", PREFIX)
        assert entry is not None and entry.tier is Tier.RESIDENT and entry.lane == 0
        lease = cache.lease("req", PREFIX + SUFFIX)
        assert lease is not None and lease.tokens == tuple(PREFIX)
        assert entry.pins == {"req"}
        placement, restored = start(runtime, cache, "req")
        assert placement.lane == entry.lane and placement.keep_tokens == len(PREFIX)
        assert restored
        assert greedy_continue(runtime, "req", SUFFIX, 8) == expected
        cache.release(lease)
        assert entry.pins == set()
        published = events.drain()
        names = [event.name for event in published]
        operations = {event.payload.operation for event in published}
    stats = cache.stats().as_dict()
    assert stats["hits"] == 1 and stats["misses"] == 0 and stats["matched_tokens"] == 96
    assert stats["hit_rate"] == 1.0
    assert set(names) == {PrefixCacheChanged.NAME} and "lookup" in operations


def test_a_hit_on_a_busy_lane_copies_it_into_another(runtime, expected):
    cache, _ = make_cache(runtime)
    runtime.ensure_session_active("leader")
    prefill(runtime, "leader", PREFIX + tokens(9, 20))  # still running, past the prefix
    cache.record("leader", len(PREFIX))
    assert cache.lease("req", PREFIX + SUFFIX) is not None
    placement, restored = start(runtime, cache, "req")
    assert placement.lane != runtime.lane_of("leader") and placement.keep_tokens == 0
    assert restored and runtime.session_history("req") == tuple(PREFIX)
    assert greedy_continue(runtime, "req", SUFFIX, 8) == expected


def test_a_fully_cached_prompt_still_computes_its_last_token(runtime):
    cache, _ = make_cache(runtime)
    record_from_lane(runtime, cache, "source", PREFIX)
    lease = cache.lease("again", PREFIX)
    assert lease is not None and len(lease.tokens) == len(PREFIX) - 1
    assert cache.lease("short", PREFIX[:8] + SUFFIX) is None  # below min_tokens: a miss
    assert cache.stats().misses == 1


def test_a_reused_lane_saves_its_entry_to_host_ram_and_it_restores_from_there(
        tiny_model_path, expected):
    with open_runtime(tiny_model_path, lanes=1, ctx_size=512) as runtime:
        cache, _ = make_cache(runtime)
        first = record_from_lane(runtime, cache, "a", PREFIX)
        assert cache.lease("other", OTHER) is None
        start(runtime, cache, "other")  # the only lane goes to an unrelated request
        assert first.tier is Tier.HOST and first.lane is None
        assert cache.stats().bytes_host > 0 and cache.stats().evictions == 1
        prefill(runtime, "other", OTHER)
        cache.record("other", len(OTHER))
        runtime.drop_session("other")
        assert cache.lease("req", PREFIX + SUFFIX) is not None
        placement, restored = start(runtime, cache, "req")
        assert restored and placement.keep_tokens == 0
        assert greedy_continue(runtime, "req", SUFFIX, 8) == expected
        # "other" went to host RAM in turn; the restored entry stays there too.
        assert cache.stats().entries_host == 2


def test_at_the_host_budget_a_demotion_saves_into_its_victim_s_mapping(
        tiny_model_path, expected):
    with open_runtime(tiny_model_path, lanes=1, ctx_size=512) as runtime:
        probe, _ = make_cache(runtime)
        record_from_lane(runtime, probe, "probe", PREFIX)
        start(runtime, probe, "probe-next")  # "probe" goes to host RAM: what one costs
        one_entry = probe.stats().bytes_host + 4096
        runtime.drop_session("probe-next")
        probe.clear()
        runtime.clear_lane(0)
        cache, _ = make_cache(runtime, host_ram_bytes=one_entry)  # room for one state
        record_from_lane(runtime, cache, "a", PREFIX)
        start(runtime, cache, "b")  # "a" goes to host RAM in a fresh mapping
        prefill(runtime, "b", OTHER)
        cache.record("b", len(OTHER))
        runtime.drop_session("b")
        reused_before = runtime.state_mappings.reused
        start(runtime, cache, "c")  # "b" goes to host RAM; "a" gives way, and its mapping
        runtime.drop_session("c")
        assert runtime.state_mappings.reused == reused_before + 1
        assert cache.stats().entries_host == 1 and cache.stats().bytes_host <= one_entry
        assert cache.lease("req", OTHER + SUFFIX) is not None
        placement, restored = start(runtime, cache, "req")
        assert restored
        with open_runtime(tiny_model_path) as fresh:
            prefill(fresh, "ref", OTHER)
            assert greedy_continue(runtime, "req", SUFFIX, 8) == greedy_continue(
                fresh, "ref", SUFFIX, 8)


def test_without_host_room_a_reused_lane_loses_its_entry(tiny_model_path):
    with open_runtime(tiny_model_path, lanes=1, ctx_size=512) as runtime:
        cache, _ = make_cache(runtime, host_ram_bytes=1024)
        record_from_lane(runtime, cache, "a", PREFIX)
        start(runtime, cache, "b")
        runtime.drop_session("b")
        assert cache.lease("req", PREFIX + SUFFIX) is None
        assert cache.stats().bytes_host == 0 and cache.stats().evictions == 1


def test_a_stale_entry_is_dropped_at_lookup(runtime):
    cache, _ = make_cache(runtime)
    entry = record_from_lane(runtime, cache, "a", PREFIX)
    runtime.ensure_session_active("b", lane=entry.lane)  # reused behind the cache's back
    prefill(runtime, "b", OTHER)
    assert cache.lease("req", PREFIX + SUFFIX) is None
    assert entry.id not in cache.table.entries


def test_a_longer_record_supersedes_its_unpinned_prefix_in_the_same_lane(runtime):
    cache, _ = make_cache(runtime)
    runtime.ensure_session_active("b")
    prefill(runtime, "b", PREFIX[:40])
    short = cache.record("b", 40)
    prefill(runtime, "b", PREFIX[40:])
    long = cache.record("b", len(PREFIX))
    assert short.id not in cache.table.entries and long.id in cache.table.entries
    assert cache.record("b", 50) is long  # already covered: no new entry
    assert cache.stats().records == 2


def test_a_new_request_takes_the_lowest_idle_lane_and_its_entry_moves_to_host(runtime):
    # Busy lanes stay contiguous (one micro-batch): lane 0 is taken although lane 1 is
    # empty, and what lane 0 held survives in host RAM.
    cache, _ = make_cache(runtime)
    entry = record_from_lane(runtime, cache, "a", PREFIX)
    placement, restored = start(runtime, cache, "miss")
    assert placement.lane == 0 and not restored
    assert entry.tier is Tier.HOST
    assert cache.lease("again", PREFIX + SUFFIX) is not None


def test_a_hit_whose_lane_is_not_the_lowest_idle_one_is_copied_down(runtime, expected):
    cache, _ = make_cache(runtime)
    runtime.ensure_session_active("blocker")  # lane 0
    entry = record_from_lane(runtime, cache, "a", PREFIX)  # lane 1
    runtime.drop_session("blocker")  # lane 0 is idle again, and lower
    assert cache.lease("req", PREFIX + SUFFIX) is not None
    placement, restored = start(runtime, cache, "req")
    assert placement.lane == 0 and restored and entry.lane == 1
    assert greedy_continue(runtime, "req", SUFFIX, 8) == expected


def test_an_in_place_hit_on_part_of_a_lane_saves_the_rest_first(runtime, expected):
    cache, _ = make_cache(runtime)
    longer = record_from_lane(runtime, cache, "chat", PREFIX + OTHER)  # a conversation
    assert cache.lease("req", PREFIX + SUFFIX) is not None  # shares only PREFIX with it
    placement, restored = start(runtime, cache, "req")
    assert placement.lane == 0 and placement.keep_tokens == len(PREFIX) and restored
    assert longer.tier is Tier.HOST  # the conversation survives the trim, in host RAM
    assert greedy_continue(runtime, "req", SUFFIX, 8) == expected
    assert cache.lease("chat-again", PREFIX + OTHER + SUFFIX) is not None
    _, restored = start(runtime, cache, "chat-again")
    assert restored and runtime.session_history("chat-again") == tuple(PREFIX + OTHER)
