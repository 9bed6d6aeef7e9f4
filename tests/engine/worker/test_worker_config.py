"""How the worker sizes its policy from the runtime."""

from __future__ import annotations

import pytest
from fake_runtime import EventRecorder

from skippyd.config import parse_config
from skippyd.engine.policy import UNLIMITED
from skippyd.engine.worker.generation_events import CompleteEvent, GenerationRequest, TokenEvent
from skippyd.engine.worker.settings import (
    DECODE_BATCH_HEADROOM_TOKENS,
    WorkerSettings,
    admission_tokens,
    build_scheduler_config,
    iteration_token_budget,
    kv_capacity_tokens,
)


def test_activation_export_stages_cap_iteration_tokens_at_the_native_microbatch():
    assert iteration_token_budget(True, 2048, 256) == 256
    assert iteration_token_budget(True, 2048, 512) == 512
    assert iteration_token_budget(True, 128, 512) == 128
    assert iteration_token_budget(False, 2048, 512) == 2048


# A stage that exports holds back each prompt's last 8 tokens for a chunk of its own
# (SchedulerConfig.sample_tail_tokens): two prompts of 256 fill its 512 as 2 x 248.
@pytest.mark.parametrize(("exports", "tokens", "works"), [(True, 496, 2), (False, 1024, 4)])
def test_planned_prefills_share_the_export_microbatch_budget(
    runtime_factory, make_handle, blocked_worker, exports, tokens, works
):
    runtime = runtime_factory(lane_count=4, kv_pool_tokens=4096, n_batch=2048, n_ubatch=512)
    worker = make_handle(runtime, queue_capacity=8, exports=exports)
    _, release = blocked_worker(worker)
    recorders = []
    for index in range(4):
        recorder = EventRecorder()
        request = GenerationRequest(f"r{index}", [index + 1] * 256, max_tokens=1)
        worker.submit_generation(request, recorder)
        recorders.append(recorder)
    release.set()
    for recorder in recorders:
        assert isinstance(recorder.next(), TokenEvent)
        assert isinstance(recorder.next(), CompleteEvent)
    first_call = runtime.calls[0]
    assert sum(request.num_tokens for request in first_call) == tokens
    assert len(first_call) == works


def test_server_scheduler_config_uses_runtime_lanes_and_native_batch_limits():
    config = build_scheduler_config(32, 131072, 1024, 4096, 128, 64)
    assert config.max_active_sequences == 32
    assert config.max_waiting_sequences == 64
    assert config.max_tokens_per_iteration == 2048
    assert config.prefill_chunk_tokens == 128
    assert config.max_consecutive_prefill_iterations == 1
    assert config.max_prefill_sequences_per_iteration == 1
    assert config.mixed_prefill_decode is False
    kv, recurrent = config.memory_components
    assert (kv.name, kv.capacity, kv.per_token, kv.per_sequence) == (
        "kv-cells", 131072, 1, 0)
    assert (recurrent.name, recurrent.capacity, recurrent.per_sequence) == (
        "recurrent-state", 65536, 1024)
    assert recurrent.per_token == 0
    assert kv_capacity_tokens(config) == 131072

    attention_only = build_scheduler_config(32, 131072, 0, 4096, 128, 64)
    assert attention_only.mixed_prefill_decode is True
    assert attention_only.max_prefill_sequences_per_iteration == UNLIMITED
    assert len(attention_only.memory_components) == 1


def test_degenerate_sizes_are_clamped_to_one():
    config = build_scheduler_config(0, 0, 0, 0, 0, 0)
    assert config.max_active_sequences == 1
    assert config.max_waiting_sequences == 1
    assert config.max_tokens_per_iteration == 1
    assert config.prefill_chunk_tokens == 1
    assert kv_capacity_tokens(config) == 1


def test_the_runtime_is_the_one_source_of_the_batch_sizes(runtime_factory):
    runtime = runtime_factory(lane_count=3, kv_pool_tokens=1000, n_batch=4096, n_ubatch=96)
    settings = WorkerSettings.derive(runtime, queue_capacity=5)
    assert settings.policy.max_tokens_per_iteration == 2048  # the native cap
    assert settings.policy.prefill_chunk_tokens == 96
    assert settings.max_direct_iteration_tokens == 2048
    assert kv_capacity_tokens(settings.policy) == 1000
    exporting = WorkerSettings.derive(runtime, queue_capacity=5, exports=True)
    assert exporting.policy.max_tokens_per_iteration == 96


def test_settings_for_a_stage_follow_its_config(runtime_factory):
    runtime = runtime_factory(lane_count=4)
    config = parse_config({"runtime": {"lane_count": 4, "queue_capacity": 9}}, environ={})
    settings = WorkerSettings.for_stage(config, runtime)
    assert settings.policy.max_waiting_sequences == 9
    assert settings.command_queue_capacity == 9 + 4
    assert (settings.safe_mode, settings.policy.max_active_sequences) == (False, 4)
    assert (settings.policy.target_step_us, settings.policy.target_decode_steps) == (250_000, 4)
    fixed = parse_config({"runtime": {"target_step_ms": 400, "target_decode_steps": 0}},
                         environ={})
    settings = WorkerSettings.for_stage(fixed, runtime)
    assert (settings.policy.target_step_us, settings.policy.target_decode_steps) == (400_000, 0)
    later = parse_config({"stage": {"index": 1, "layer_start": 2},
                          "upstream": {"stage_id": "a", "stage_index": 0,
                                       "endpoint": "127.0.0.1:9000"},
                          "link": {"listen": "127.0.0.1:9001", "secret": "s" * 16},
                          "runtime": {"lane_count": 4}}, environ={})
    settings = WorkerSettings.for_stage(later, runtime)
    assert later.planned_decode_groups == 2  # final stage 1 of 2
    assert settings.direct_group_batch_size == 2
    safe = parse_config({}, environ={"SKIPPYD_SAFE_MODE": "on"})
    settings = WorkerSettings.for_stage(safe, runtime)
    assert settings.safe_mode and settings.policy.max_active_sequences == 1


def test_admission_reserves_bounded_decode_headroom():
    assert admission_tokens(100, 10, 4096) == 110
    assert admission_tokens(100, 100_000, 4096) == 100 + DECODE_BATCH_HEADROOM_TOKENS
    assert admission_tokens(4000, 1000, 4096) == 4096
