"""The scheduler's rules: admission, planning, completion and preemption."""

from __future__ import annotations

import pytest
from policy_helpers import make_scheduler, make_sequence, run_step, sampling_predictions, work_ids

import skippyd.engine.policy.scheduler as scheduler_module
from skippyd.engine.policy import (
    CacheAffinity,
    IterationPhase,
    IterationPrediction,
    MemoryComponent,
    PrefixRestore,
    PrefixRestoreKind,
    StageCacheAffinity,
    WaitingQueueFullError,
)

DECODE, PREFILL, RECOMPUTE = IterationPhase.DECODE, IterationPhase.PREFILL, IterationPhase.RECOMPUTE


def _calibrated_decoder(budget: int, **overrides: object):
    """A mixed-mode scheduler whose 'decoder' is live with a 10 ms one-row baseline."""
    scheduler = make_scheduler(
        max_tokens_per_iteration=budget, mixed_prefill_decode=True, **overrides
    )
    scheduler.submit(make_sequence("decoder", [1, 2], max_tokens=100))
    run_step(scheduler)  # prefill, samples the first token
    decode_plan = scheduler.plan_iteration()
    assert [w.phase for w in decode_plan.work] == [DECODE]
    scheduler.observe_iteration_duration(decode_plan, 0.010)
    scheduler.complete_iteration(decode_plan, sampling_predictions(decode_plan))
    return scheduler


def test_iteration_separates_prefill_and_decode_without_replaying_final_prompt_token():
    scheduler = make_scheduler()
    scheduler.submit(make_sequence("a", [11, 12, 13, 14]))
    plan = scheduler.plan_iteration()
    [work] = plan.work
    assert (work.phase, work.tokens, work.positions, work.sample_last) == (
        PREFILL, (11, 12, 13, 14), (0, 1, 2, 3), True)
    scheduler.complete_iteration(plan, [IterationPrediction(0, 50)])

    plan = scheduler.plan_iteration()
    [work] = plan.work
    # The prompt's last token (14) is not replayed: the sampled token decodes at position 4.
    assert (work.phase, work.tokens, work.positions, work.sample_last) == (
        DECODE, (50,), (4,), True)
    scheduler.complete_iteration(plan, [IterationPrediction(0, 51)])

    scheduler.submit(make_sequence("b", [21, 22, 23]))
    plan = scheduler.plan_iteration()
    assert [(w.sequence_id, w.phase) for w in plan.work] == [("b", PREFILL)]
    scheduler.complete_iteration(plan, [IterationPrediction(0, 60)])

    plan = scheduler.plan_iteration()
    assert [(w.sequence_id, w.phase, w.positions) for w in plan.work] == [
        ("a", DECODE, (5,)), ("b", DECODE, (3,))]


def test_bounded_prefill_iterations_allow_live_decode_progress():
    scheduler = make_scheduler(max_consecutive_prefill_iterations=1, prefill_chunk_tokens=4)
    scheduler.submit(make_sequence("a", 2, max_tokens=50))
    run_step(scheduler)
    scheduler.submit(make_sequence("b", 12, max_tokens=50))
    phases = []
    for _ in range(6):
        plan, _ = run_step(scheduler)
        phases.append([(w.sequence_id, w.phase) for w in plan.work])
    assert phases == [
        [("b", PREFILL)], [("a", DECODE)],
        [("b", PREFILL)], [("a", DECODE)],
        [("b", PREFILL)], [("a", DECODE), ("b", DECODE)],
    ]


def test_mixed_iteration_schedules_decode_first_and_fills_remaining_budget():
    scheduler = _calibrated_decoder(budget=5)
    scheduler.submit(make_sequence("prompt", 8))
    plan = scheduler.plan_iteration()
    assert [(w.sequence_id, w.phase, w.token_count) for w in plan.work] == [
        ("decoder", DECODE, 1), ("prompt", PREFILL, 4)]
    assert plan.token_count == 5

    wide = _calibrated_decoder(budget=128)
    wide.submit(make_sequence("prompt", 512))
    plan = wide.plan_iteration()
    assert [(w.sequence_id, w.phase, w.token_count) for w in plan.work] == [
        ("decoder", DECODE, 1), ("prompt", PREFILL, 127)]


def test_mixed_decode_budget_rotates_across_all_live_sequences():
    scheduler = make_scheduler(max_tokens_per_iteration=2, mixed_prefill_decode=True)
    for name in ("a", "b", "c"):
        scheduler.submit(make_sequence(name, 1, max_tokens=100))
    run_step(scheduler)  # a, b prefill
    run_step(scheduler)  # c prefill
    plan = scheduler.plan_iteration()  # homogeneous decode of two rows: the baseline
    assert work_ids(plan) == ["a", "b"]
    scheduler.observe_iteration_duration(plan, 0.004)
    scheduler.complete_iteration(plan, sampling_predictions(plan))
    rotations = [work_ids(run_step(scheduler)[0]) for _ in range(3)]
    assert rotations == [["a", "b"], ["c", "a"], ["b", "c"]]


def test_duration_aware_mixed_admission_caps_slow_prompt_work():
    scheduler = _calibrated_decoder(budget=128)
    scheduler.submit(make_sequence("prompt", 512))
    mixed = scheduler.plan_iteration()
    assert [w.phase for w in mixed.work] == [DECODE, PREFILL]
    scheduler.observe_iteration_duration(mixed, 0.170)
    scheduler.complete_iteration(mixed, sampling_predictions(mixed))
    assert scheduler.mixed_prefill_viable is False
    plan = scheduler.plan_iteration()
    assert [(w.sequence_id, w.phase, w.token_count) for w in plan.work] == [
        ("prompt", PREFILL, 128)]


def test_mixed_admission_waits_for_the_matching_decode_row_baseline():
    scheduler = _calibrated_decoder(budget=128)
    scheduler.submit(make_sequence("second", [5, 6], max_tokens=100))
    run_step(scheduler)  # mixed: decoder decodes, second prefills and samples
    scheduler.submit(make_sequence("prompt", 512))
    plan = scheduler.plan_iteration()
    # Two live decoders but a baseline only for one row: phase-homogeneous prompt work.
    assert [(w.sequence_id, w.phase) for w in plan.work] == [("prompt", PREFILL)]
    assert scheduler.mixed_prefill_viable is True


def test_duration_aware_mixed_admission_keeps_cheap_prompt_work():
    scheduler = _calibrated_decoder(budget=128)
    scheduler.submit(make_sequence("prompt", 512))
    mixed = scheduler.plan_iteration()
    scheduler.observe_iteration_duration(mixed, 0.018)  # 8 ms extra: exactly allowed
    scheduler.complete_iteration(mixed, sampling_predictions(mixed))
    assert scheduler.mixed_prefill_viable is True
    plan = scheduler.plan_iteration()
    assert [(w.sequence_id, w.phase, w.token_count) for w in plan.work] == [
        ("decoder", DECODE, 1), ("prompt", PREFILL, 127)]


def test_sparse_iteration_predictions_map_to_their_explicit_work_rows():
    scheduler = _calibrated_decoder(budget=16, prefill_chunk_tokens=4)
    scheduler.submit(make_sequence("long", 10))
    scheduler.submit(make_sequence("short", 2))
    plan = scheduler.plan_iteration()
    assert [(w.sequence_id, w.sample_last) for w in plan.work] == [
        ("decoder", True), ("long", False), ("short", True)]
    before = scheduler.sequence("decoder").generated_tokens
    scheduler.complete_iteration(plan, [IterationPrediction(2, 222), IterationPrediction(0, 111)])
    assert scheduler.sequence("decoder").generated_tokens == [*before, 111]
    assert scheduler.sequence("short").generated_tokens == [222]
    assert scheduler.sequence("long").generated_tokens == []


def test_admission_uses_effective_minimum_across_components():
    scheduler = make_scheduler(memory_components=[
        MemoryComponent("kv-cells", capacity=1 << 30, per_token=1),
        MemoryComponent("recurrent-state", capacity=1024, per_sequence=1024),
    ])
    scheduler.submit(make_sequence("a", 4))
    scheduler.submit(make_sequence("b", 4))
    plan = scheduler.plan_iteration()
    assert plan.admitted == 1
    snapshot = scheduler.snapshot()
    assert (snapshot.active_ids, snapshot.waiting_ids) == (("a",), ("b",))
    assert snapshot.component_used == (("kv-cells", 12), ("recurrent-state", 1024))


def test_admission_groups_the_heaviest_waiting_prefix_subtree():
    scheduler = make_scheduler(max_active_sequences=1)
    scheduler.submit(make_sequence("unique", [9, 9, 9]))
    scheduler.submit(make_sequence("shared-a", [1, 2, 3]))
    scheduler.submit(make_sequence("shared-b", [1, 2, 4]))
    plan = scheduler.plan_iteration()
    assert work_ids(plan) == ["shared-a"]
    assert scheduler.snapshot().waiting_ids == ("shared-b", "unique")


def test_prefill_sequence_limit_serializes_recurrent_prefills():
    scheduler = make_scheduler(max_prefill_sequences_per_iteration=1)
    scheduler.submit(make_sequence("a", 2))
    scheduler.submit(make_sequence("b", 2))
    first, _ = run_step(scheduler)
    second, _ = run_step(scheduler)
    assert [(w.sequence_id, w.phase) for w in first.work] == [("a", PREFILL)]
    assert [(w.sequence_id, w.phase) for w in second.work] == [("b", PREFILL)]


def test_prefix_restore_skips_only_the_restored_token_span():
    scheduler = make_scheduler()
    restore = PrefixRestore("page-1", 6, PrefixRestoreKind.RESIDENT_KV)
    scheduler.submit(make_sequence("a", [10, 11, 12, 13, 14, 15, 16, 17]).with_prefix_restore(
        restore))
    [work] = scheduler.plan_iteration().work
    assert (work.tokens, work.positions, work.sample_last) == ((16, 17), (6, 7), True)
    assert scheduler.metrics().prefix_hits == 1


def test_full_prefix_restore_replays_the_final_token_for_logits():
    scheduler = make_scheduler()
    restore = PrefixRestore("page-1", 8, PrefixRestoreKind.RESIDENT_KV)
    scheduler.submit(make_sequence("a", [10, 11, 12, 13, 14, 15, 16, 17]).with_prefix_restore(
        restore))
    [work] = scheduler.plan_iteration().work
    assert (work.tokens, work.positions, work.sample_last) == ((17,), (7,), True)


def test_overload_is_rejected_before_native_decode():
    scheduler = make_scheduler(max_waiting_sequences=1)
    scheduler.submit(make_sequence("a", 2))
    with pytest.raises(WaitingQueueFullError, match=r"waiting queue is full \(1 requests\)"):
        scheduler.submit(make_sequence("b", 2))
    assert scheduler.metrics().rejected_overload == 1
    assert work_ids(scheduler.plan_iteration()) == ["a"]


def test_missing_sample_prediction_fails_instead_of_finishing_sequence():
    scheduler = make_scheduler()
    scheduler.submit(make_sequence("a", 2))
    plan = scheduler.plan_iteration()
    telemetry = scheduler.complete_iteration(plan, [])
    assert scheduler.sequence("a") is None
    assert (telemetry.failed, telemetry.finished, telemetry.failed_ids) == (1, 0, ("a",))


def test_cancellation_releases_memory_and_removes_waiting_or_active_sequence():
    scheduler = make_scheduler(
        max_active_sequences=1,
        memory_components=[MemoryComponent("kv", capacity=1000, per_token=1)],
    )
    scheduler.submit(make_sequence("active", 4))
    scheduler.submit(make_sequence("waiting", 4))
    scheduler.plan_iteration()
    assert scheduler.snapshot().component_used == (("kv", 12),)
    assert scheduler.cancel("active") and scheduler.cancel("waiting")
    assert not scheduler.cancel("waiting")
    snapshot = scheduler.snapshot()
    assert (snapshot.active_ids, snapshot.waiting_ids) == ((), ())
    assert snapshot.component_used == (("kv", 0),)
    assert scheduler.metrics().cancelled == 2


def test_repeated_component_preemption_preserves_aging_credit():
    scheduler = make_scheduler(
        max_active_sequences=1,
        cache_aging_cost_per_iteration=10,
        memory_components=[MemoryComponent("kv", capacity=1000, per_token=1)],
    )
    hot = CacheAffinity.from_stage(StageCacheAffinity(0, 40, 2))  # saved cost 80
    scheduler.submit(make_sequence("cold", 4, max_tokens=500))
    for _ in range(9):  # turns 1..9: cold prefills, then decodes
        run_step(scheduler)
    for round_index, turn in enumerate((10, 11)):
        assert scheduler.preempt_for_component_pressure([1001]) == ["cold"]
        scheduler.preempt_for_component_pressure([0])  # the runtime freed the victim's cells
        scheduler.submit(make_sequence(f"hot-{round_index}", 4).with_cache_affinity(hot))
        plan = scheduler.plan_iteration()
        # cold: age turn*10 >= 100; hot: 80 + 10 for one turn -> cold keeps winning.
        assert work_ids(plan) == ["cold"], turn
        assert plan.work[0].phase is RECOMPUTE
        assert scheduler.sequence("cold").enqueued_turn == 0
        scheduler.complete_iteration(plan, sampling_predictions(plan))
    assert scheduler.metrics().preempted == 2


def test_preempted_sequence_recomputes_then_decodes_its_pending_token():
    scheduler = make_scheduler(
        prefill_chunk_tokens=3,
        memory_components=[MemoryComponent("kv", capacity=100, per_token=1)],
    )
    scheduler.submit(make_sequence("a", [10, 11, 12, 13], max_tokens=10))
    run_step(scheduler)  # first prefill chunk, no sampling
    run_step(scheduler, token=20)  # last prefill chunk, samples 20
    run_step(scheduler, token=21)  # decodes 20 at position 4, samples 21
    assert scheduler.preempt_for_component_pressure([101]) == ["a"]
    assert scheduler.sequence("a").status.value == "preempted"
    scheduler.preempt_for_component_pressure([0])
    chunks = [scheduler.plan_iteration() for _ in range(2)]
    assert [(w.phase, w.tokens, w.positions, w.sample_last) for p in chunks for w in p.work] == [
        (RECOMPUTE, (10, 11, 12), (0, 1, 2), False), (RECOMPUTE, (13, 20), (3, 4), False)]
    for plan in chunks:
        scheduler.complete_iteration(plan, [])  # recompute rows never sample: nothing fails
    [work] = scheduler.plan_iteration().work
    assert (work.phase, work.tokens, work.positions) == (DECODE, (21,), (5,))
    metrics = scheduler.metrics()
    assert (metrics.recompute_tokens, metrics.failed, metrics.preempted) == (5, 0, 1)


def test_preemption_picks_the_latest_admission():
    scheduler = make_scheduler(
        max_active_sequences=2,
        memory_components=[MemoryComponent("kv", capacity=100, per_token=1)],
    )
    scheduler.submit(make_sequence("old", 2, max_tokens=10))
    scheduler.submit(make_sequence("gone", 2, max_tokens=10))
    run_step(scheduler)
    scheduler.cancel("gone")
    scheduler.submit(make_sequence("new", 2, max_tokens=10))
    run_step(scheduler)
    assert scheduler.snapshot().active_ids == ("new", "old")
    # Each holds 12 units; 104 observed -> dropping the latest admission (new) suffices.
    assert scheduler.preempt_for_component_pressure([104]) == ["new"]
    assert scheduler.snapshot().waiting_ids == ("new",)
    assert scheduler.snapshot().component_used == (("kv", 92),)
    scheduler.preempt_for_component_pressure([0])
    run_step(scheduler)
    assert scheduler.snapshot().active_ids == ("new", "old")
    assert scheduler.preempt_for_component_pressure([500]) == ["new", "old"]


def test_waiting_queue_is_resorted_only_when_it_changes(monkeypatch):
    calls = []
    original = scheduler_module.order_cache_aware_candidates

    def counting(*args, **kwargs):
        calls.append(len(args[0]))
        return original(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "order_cache_aware_candidates", counting)
    scheduler = make_scheduler(max_active_sequences=1, cache_aging_cost_per_iteration=10)
    hot = CacheAffinity.from_stage(StageCacheAffinity(0, 100, 1))  # saved cost 100
    scheduler.submit(make_sequence("blocker", [7, 7], max_tokens=1000))
    run_step(scheduler)  # the blocker takes the only lane
    calls.clear()
    scheduler.submit(make_sequence("cold", [8, 8]))
    scheduler.submit(make_sequence("hot", [9, 9]).with_cache_affinity(hot))
    run_step(scheduler)
    assert calls == [2]
    assert scheduler.snapshot().waiting_ids == ("hot", "cold")
    for _ in range(10):
        run_step(scheduler)  # ages grow, but nothing changed the queue: no re-sort
    assert calls == [2]
    scheduler.submit(make_sequence("late", [6, 6]).with_cache_affinity(hot))
    run_step(scheduler)
    scheduler.cancel("cold")
    run_step(scheduler)
    assert calls == [2, 3, 2]
    # "late" has the same saved cost as "hot" but 11 turns less credit.
    assert scheduler.snapshot().waiting_ids == ("hot", "late")


def test_admission_skips_a_request_that_does_not_fit_without_blocking_later_ones():
    scheduler = make_scheduler(
        memory_components=[MemoryComponent("kv", capacity=40, per_token=1)])
    scheduler.submit(make_sequence("small-1", 4, max_tokens=6))
    scheduler.submit(make_sequence("huge", 30, max_tokens=20))
    scheduler.submit(make_sequence("small-2", 4, max_tokens=6))
    plan = scheduler.plan_iteration()
    assert work_ids(plan) == ["small-1", "small-2"]
    assert scheduler.snapshot().waiting_ids == ("huge",)
    assert scheduler.snapshot().component_used == (("kv", 20),)


def test_plan_is_fresh_and_survives_dropped_works():
    scheduler = make_scheduler()
    scheduler.submit(make_sequence("a", 2))
    scheduler.submit(make_sequence("b", 3))
    plan = scheduler.plan_iteration()
    assert plan.token_count == 5 and plan.admitted == 2
    scheduler.cancel("b")
    kept = plan.without_sequences(["b"])
    assert (work_ids(kept), kept.token_count, work_ids(plan)) == (["a"], 2, ["a", "b"])
    plan.work.clear()  # the caller owns the plan: this must not touch the scheduler
    telemetry = scheduler.complete_iteration(kept, [IterationPrediction(0, 9)])
    assert telemetry.prefill_tokens == 2
    assert scheduler.sequence("a").generated_tokens == [9]


def test_preempt_one_uses_the_victim_rule_without_memory_pressure():
    scheduler = make_scheduler(
        memory_components=[MemoryComponent("kv", capacity=100, per_token=1)])
    scheduler.submit(make_sequence("important", [1, 2], max_tokens=10))
    scheduler.submit(make_sequence("first", [3, 4], max_tokens=10))
    run_step(scheduler)
    scheduler.submit(make_sequence("second", [5, 6], max_tokens=10))
    run_step(scheduler)
    assert scheduler.preempt_one() == "second"
    assert scheduler.snapshot().component_used == (("kv", 24),)
    assert scheduler.preempt_one() == "first"
    assert scheduler.preempt_one() == "important"
    assert scheduler.preempt_one() is None
    assert scheduler.snapshot().waiting_ids == ("important", "first", "second")
    assert scheduler.metrics().preempted == 3


def test_progress_reports_each_active_sequence_without_a_waiting_one():
    scheduler = make_scheduler(max_active_sequences=2, max_tokens_per_iteration=3)
    scheduler.submit(make_sequence("b", [1, 2]))
    scheduler.submit(make_sequence("a", [1, 2, 3, 4, 5, 6]))
    scheduler.submit(make_sequence("waiting", [1, 2]))
    assert scheduler.progress() == ()
    run_step(scheduler)
    progress = {p.sequence_id: p for p in scheduler.progress()}
    assert [p.sequence_id for p in scheduler.progress()] == ["a", "b"]
    assert progress["a"].prompt_tokens == 6 and progress["a"].replaying
    run_step(scheduler)
    run_step(scheduler)
    after = {p.sequence_id: p for p in scheduler.progress()}
    assert after["b"].generated_tokens >= 1 and not after["b"].replaying
    assert sum(p.generated_tokens for p in scheduler.progress()) == sum(
        len(scheduler.sequence(i).generated_tokens) for i in ("a", "b"))
