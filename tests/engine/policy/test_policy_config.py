"""SchedulerConfig defaults and normalisation, memory components, data-model rules."""

from __future__ import annotations

import pytest
from policy_helpers import make_scheduler, make_sequence

from skippyd.engine.policy import (
    LLAMA_MAX_SEQ,
    UNLIMITED,
    DuplicateSequenceError,
    EmptyPromptError,
    IterationPrediction,
    MemoryComponent,
    PolicyInputError,
    PrefixRestore,
    ScheduledSequence,
    SchedulerConfig,
    SchedulerConfigError,
    SequenceStatus,
)


def test_the_sequence_limit_is_llama_cpps():
    config = SchedulerConfig(max_active_sequences=UNLIMITED)
    assert config.normalized().max_active_sequences == LLAMA_MAX_SEQ


def test_request_memory_includes_fixed_recurrent_state():
    recurrent = MemoryComponent("recurrent-state", capacity=1 << 20, per_sequence=4096)
    assert recurrent.request_cost(1, 1) == 4096
    assert recurrent.request_cost(10_000, 512) == 4096
    kv = MemoryComponent("kv-cells", capacity=1 << 20, per_token=2,
                         per_sequence=7)
    assert kv.request_cost(10, 5) == 7 + 2 * 15
    assert kv.reservation(20) == 7 + 2 * 20


def test_defaults_are_a_default_stage_s_and_already_normalized():
    config = SchedulerConfig()
    assert (config.max_active_sequences, config.max_waiting_sequences,
            config.max_tokens_per_iteration, config.prefill_chunk_tokens,
            config.cache_aging_cost_per_iteration) == (4, 64, 2048, 512, 4096)
    assert config.max_prefill_sequences_per_iteration == UNLIMITED
    assert config.max_consecutive_prefill_iterations == 1
    assert (config.mixed_prefill_decode, config.group_waiting_prefixes) == (True, True)
    assert config.target_step_us == 250_000
    assert config.memory_components == ()
    assert config.normalized() == config


def test_normalization_clamps_zero_and_oversize_values():
    config = SchedulerConfig(
        max_active_sequences=0, max_waiting_sequences=0,
        max_tokens_per_iteration=0, prefill_chunk_tokens=4096,
        max_prefill_sequences_per_iteration=0, max_consecutive_prefill_iterations=0,
        cache_aging_cost_per_iteration=0,
    ).normalized()
    assert (config.max_active_sequences, config.max_waiting_sequences,
            config.max_tokens_per_iteration, config.prefill_chunk_tokens,
            config.max_prefill_sequences_per_iteration,
            config.max_consecutive_prefill_iterations,
            config.cache_aging_cost_per_iteration) == (1, 1, 1, 1, 1, 1, 1)
    assert SchedulerConfig(max_tokens_per_iteration=100).normalized().prefill_chunk_tokens == 100
    assert make_scheduler(max_active_sequences=999).config \
        .max_active_sequences == LLAMA_MAX_SEQ


@pytest.mark.parametrize(("field", "value"), [
    ("max_active_sequences", -1), ("max_tokens_per_iteration", 2.5),
    ("prefill_chunk_tokens", True), ("mixed_prefill_decode", 1),
    ("memory_components", ["kv"]), ("target_decode_steps", -1.0),
    ("target_decode_steps", float("nan")), ("target_decode_steps", True),
    ("target_decode_steps", 1e300),
])
def test_invalid_config_values_raise_a_typed_error_naming_the_field(field, value):
    with pytest.raises(SchedulerConfigError) as caught:
        SchedulerConfig(**{field: value})
    assert caught.value.field == field


def test_invalid_memory_component_is_rejected():
    with pytest.raises(SchedulerConfigError, match="per_token"):
        MemoryComponent("kv", capacity=10, per_token=-1)
    with pytest.raises(SchedulerConfigError, match="unique"):
        SchedulerConfig(memory_components=[MemoryComponent("kv", 1), MemoryComponent("kv", 2)])
    assert MemoryComponent("kv", capacity=10, resident=25).available() == 0


def test_sequence_builders_follow_the_replay_rules():
    sequence = ScheduledSequence("s", [1, 2, 3, 4], 10)
    assert sequence.admission_tokens == 14
    assert sequence.with_admission_tokens(2).admission_tokens == 4  # never below the prompt
    assert sequence.with_admission_tokens(100).admission_tokens == 100
    restored = ScheduledSequence("r", [1, 2, 3, 4], 10).with_prefix_restore(PrefixRestore("p", 99))
    assert restored.prefill_cursor == 3  # at least one token is replayed for logits
    assert SequenceStatus.FAILED.is_finished() and not SequenceStatus.PREEMPTED.is_finished()


def test_reset_for_recompute_restarts_at_the_restored_prefix():
    sequence = ScheduledSequence("s", [1, 2, 3, 4], 10).with_prefix_restore(PrefixRestore("p", 2))
    sequence.generated_tokens.extend([5, 6])
    sequence.reset_for_recompute()
    assert (sequence.status, sequence.prefill_cursor, sequence.admitted_at) == (
        SequenceStatus.PREEMPTED, 2, None)
    whole = ScheduledSequence("w", [1, 2, 3], 10).with_prefix_restore(PrefixRestore("p", 3))
    whole.reset_for_recompute()
    assert whole.prefill_cursor == 2  # nothing generated yet: the last token must run


def test_bad_sequences_are_rejected_without_changing_the_scheduler():
    scheduler = make_scheduler()
    with pytest.raises(PolicyInputError, match="max_tokens"):
        ScheduledSequence("x", [1], -1)
    with pytest.raises(PolicyInputError, match="prompt_tokens"):
        ScheduledSequence("x", [1.5], 3)
    with pytest.raises(EmptyPromptError, match="at least one token"):
        scheduler.submit(ScheduledSequence("empty", [], 3))
    scheduler.submit(make_sequence("a", 2))
    with pytest.raises(DuplicateSequenceError, match="already queued or active: a"):
        scheduler.submit(make_sequence("a", 3))
    metrics = scheduler.metrics()
    assert (metrics.waiting_sequences, metrics.prefix_misses, metrics.rejected_overload) == (
        1, 1, 0)
    plan = scheduler.plan_iteration()
    with pytest.raises(DuplicateSequenceError):
        scheduler.submit(make_sequence("a", 3))  # active ids count as well
    with pytest.raises(PolicyInputError, match="IterationPrediction"):
        scheduler.complete_iteration(plan, [(0, 5)])
    assert scheduler.sequence("a").generated_tokens == []
    assert scheduler.metrics().iterations == 0


def test_the_submitted_sequence_is_the_one_scheduled_and_returned_copies_do_not_alias():
    scheduler = make_scheduler()
    original = make_sequence("a", [1, 2, 3])
    scheduler.submit(original)
    plan = scheduler.plan_iteration()
    scheduler.complete_iteration(plan, [IterationPrediction(0, 9)])
    assert original.generated_tokens == [9]  # the caller's record sees the policy's progress
    scheduler.sequence("a").generated_tokens.append(42)
    assert scheduler.sequence("a").generated_tokens == [9]
    metrics = scheduler.metrics()
    metrics.finished = 1000
    assert scheduler.metrics().finished == 0
    assert "a" in scheduler and "b" not in scheduler
