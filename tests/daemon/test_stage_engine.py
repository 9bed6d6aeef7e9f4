"""``[kv_cache]`` settings and the StageEngine's prefix-cache surface (tiny model)."""

from __future__ import annotations

import pytest
from cache_helpers import Collector, tokens

from skippyd.config import parse_config
from skippyd.daemon.assembly import StageEngine
from skippyd.engine.prefix_cache import settings_from_config
from skippyd.engine.worker.generation_events import GenerationRequest

STATS_KEYS = {"hits", "misses", "hit_rate", "matched_tokens", "queried_tokens",
              "bytes_resident", "bytes_host", "evictions"}


def kv_cache(**keys):
    return parse_config({"kv_cache": keys}).kv_cache


def test_modes_and_payloads_map_to_settings():
    assert settings_from_config(kv_cache(mode="disabled"), supported=True) is None
    assert settings_from_config(kv_cache(max_entries=0), supported=True) is None
    assert settings_from_config(kv_cache(), supported=False, reason="split") is None
    auto = settings_from_config(kv_cache(), supported=True)
    assert auto.lookup and auto.record and auto.host_tier and auto.max_entries == 64
    record_only = settings_from_config(kv_cache(mode="record"), supported=True)
    assert record_only.record and not record_only.lookup
    resident = settings_from_config(kv_cache(payload="resident-kv"), supported=True)
    assert not resident.host_tier
    no_host = settings_from_config(kv_cache(host_ram_bytes=0), supported=True)
    assert not no_host.host_tier


@pytest.fixture(params=["auto", "disabled"])
def engine(request, tiny_model_path):
    config = parse_config({
        "stage": {"id": "tiny-cache", "model_path": str(tiny_model_path)},
        "runtime": {"ctx_size": 1024, "lane_count": 2, "threads": 1},
        "kv_cache": {"mode": request.param, "min_tokens": 16, "max_entries": 4},
    })
    stage = StageEngine(config)
    stage.load()
    yield stage
    stage.close()


def generate(engine: StageEngine, req_id: str, prompt: list[int]) -> Collector:
    collector = Collector()
    engine.submit(GenerationRequest(req_id, prompt, 3), collector)
    collector.result()
    return collector


def test_the_engine_reports_cached_tokens_and_the_snapshot_counters(engine):
    shared = tokens(1, 64)
    first = generate(engine, "first", shared + tokens(2, 5))
    second = generate(engine, "second", shared + tokens(3, 5))
    stats = engine.prefix_cache_stats()
    assert set(stats) == STATS_KEYS
    if engine.config.kv_cache.mode == "disabled":
        assert second.cached_tokens == 0
        assert stats["hits"] == stats["misses"] == 0 and stats["bytes_resident"] == 0
        return
    assert first.cached_tokens == 0
    assert second.cached_tokens == len(shared)
    assert stats["hits"] == 1 and stats["misses"] == 1 and stats["hit_rate"] == 0.5
    assert stats["matched_tokens"] == len(shared) and stats["bytes_resident"] > 0
    assert stats["queried_tokens"] == 2 * (len(shared) + 5)  # every prompt token looked up
