"""How the worker sizes its policy from the runtime."""

from __future__ import annotations

import pytest
from fake_runtime import EventRecorder

from skippyd.engine.policy import UNLIMITED
from skippyd.engine.worker.commands import CompleteEvent, GenerationRequest, TokenEvent
from skippyd.engine.worker.settings import (
    DECODE_BATCH_HEADROOM_TOKENS,
    admission_tokens,
    build_scheduler_config,
    iteration_token_budget,
    kv_capacity_tokens,
)


def test_activation_export_stages_cap_iteration_tokens_at_the_native_microbatch():
    assert iteration_token_budget(True, 2048, None) == 512
    assert iteration_token_budget(True, 2048, 512) == 512
    assert iteration_token_budget(True, 128, 512) == 128
    assert iteration_token_budget(False, 2048, 512) == 2048


@pytest.mark.parametrize(("exports", "tokens", "works"), [(True, 512, 2), (False, 1024, 4)])
def test_planned_prefills_share_the_export_microbatch_budget(
    runtime_factory, make_handle, blocked_worker, exports, tokens, works
):
    runtime = runtime_factory(lane_count=4, kv_pool_tokens=4096)
    worker = make_handle(runtime, queue_capacity=8, n_batch=2048, n_ubatch=512,
                               exports=exports)
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
    assert config.reserved_sequence_ids == 0
    assert config.max_waiting_sequences == 64
    assert config.max_tokens_per_iteration == 2048
    assert config.prefill_chunk_tokens == 128
    assert config.max_consecutive_prefill_iterations == 1
    assert config.max_prefill_sequences_per_iteration == 1
    assert config.mixed_prefill_decode is False
    assert config.iteration_interval_s == 0.0
    kv, recurrent = config.memory_components
    assert (kv.name, kv.capacity_bytes, kv.bytes_per_token, kv.bytes_per_sequence) == (
        "kv-cells", 131072, 1, 0)
    assert (recurrent.name, recurrent.capacity_bytes, recurrent.bytes_per_sequence) == (
        "recurrent-state", 65536, 1024)
    assert recurrent.bytes_per_token == 0
    assert kv_capacity_tokens(config) == 131072

    attention_only = build_scheduler_config(32, 131072, 0, 4096, 128, 64)
    assert attention_only.mixed_prefill_decode is True
    assert attention_only.max_prefill_sequences_per_iteration == UNLIMITED
    assert len(attention_only.memory_components) == 1


def test_defaults_without_native_batch_settings():
    config = build_scheduler_config(0, 0, 0, None, None, 0)
    assert config.max_active_sequences == 1
    assert config.max_waiting_sequences == 1
    assert config.max_tokens_per_iteration == 2048
    assert config.prefill_chunk_tokens == 256
    assert kv_capacity_tokens(config) == 1


def test_admission_reserves_bounded_decode_headroom():
    assert admission_tokens(100, 10, 4096) == 110
    assert admission_tokens(100, 100_000, 4096) == 100 + DECODE_BATCH_HEADROOM_TOKENS
    assert admission_tokens(4000, 1000, 4096) == 4096
