"""The step-time budget: learned costs, prompt chunks sized to keep decoders moving."""

from __future__ import annotations

import pytest
from policy_helpers import make_scheduler, make_sequence, run_step, sampling_predictions

from skippyd.engine.policy import IterationPhase, IterationPlan, IterationWork
from skippyd.engine.policy.step_budget import (
    INITIAL_PREFILL_TOKENS,
    MIN_PREFILL_TOKENS,
    StepCostModel,
)


def plan_of(decode_rows: int, prefill_tokens: int) -> IterationPlan:
    work = [IterationWork(f"d{i}", (1,), (10,), True, IterationPhase.DECODE)
            for i in range(decode_rows)]
    if prefill_tokens:
        work.append(IterationWork("p", tuple(range(prefill_tokens)),
                                  tuple(range(prefill_tokens)), False, IterationPhase.PREFILL))
    return IterationPlan(work=work, token_count=decode_rows + prefill_tokens)


def test_the_step_cost_is_a_fixed_part_plus_a_part_per_token():
    costs = StepCostModel()
    assert costs.coefficients() is None and costs.estimate_us(10) is None
    costs.observe(plan_of(4, 0), 0.020)
    # One token count only: the whole step is charged per token (smaller chunks).
    assert costs.coefficients() == pytest.approx((0.0, 5_000))
    costs.observe(plan_of(4, 100), 0.220)  # 200 ms more for 100 more tokens
    fixed, per_token = costs.coefficients()
    assert per_token == pytest.approx(2_000) and fixed == pytest.approx(12_000)
    assert costs.estimate_us(54) == pytest.approx(120_000)


def test_old_samples_fade_as_the_machine_changes():
    costs = StepCostModel()
    for _ in range(5):
        costs.observe(plan_of(8, 0), 0.040)
        costs.observe(plan_of(8, 100), 0.540)
    for _ in range(60):  # twice as slow now (another load arrived)
        costs.observe(plan_of(8, 0), 0.080)
        costs.observe(plan_of(8, 100), 1.080)
    assert costs.coefficients()[1] == pytest.approx(10_000, rel=0.02)


@pytest.mark.parametrize("elapsed", [0.0, -1.0, float("nan"), float("inf"), True])
def test_unusable_durations_are_ignored(elapsed):
    costs = StepCostModel()
    costs.observe(plan_of(2, 0), elapsed)
    assert costs.coefficients() is None


def test_the_budget_fills_the_target_beside_the_decode_rows():
    costs = StepCostModel()
    assert costs.prefill_budget(0, 200_000, 2000) == 2000  # nobody waits: everything
    assert costs.prefill_budget(4, 200_000, 2000) == INITIAL_PREFILL_TOKENS  # not learned
    costs.observe(plan_of(4, 0), 0.040)
    costs.observe(plan_of(4, 100), 0.540)  # 5 ms a token beside 20 ms fixed
    assert costs.prefill_budget(4, 200_000, 2000) == 32  # (200 - 20 fixed - 4 * 5) / 5
    assert costs.prefill_budget(4, 200_000, 10) == 10
    assert costs.prefill_budget(4, 50_000, 2000) == MIN_PREFILL_TOKENS  # prompts still move


def test_decoders_get_a_row_every_step_while_a_long_prompt_is_chunked():
    scheduler = make_scheduler(mixed_prefill_decode=True, target_step_us=200_000,
                               max_tokens_per_iteration=512, prefill_chunk_tokens=512,
                               max_active_sequences=4)
    for name in ("a", "b"):
        scheduler.submit(make_sequence(name, 4, max_tokens=50))
    run_step(scheduler)  # both prompts whole: nobody was decoding
    scheduler.submit(make_sequence("long", 300, max_tokens=4))
    chunks = []
    for _ in range(12):
        plan = scheduler.plan_iteration()
        decode = [w.sequence_id for w in plan.work if w.phase is IterationPhase.DECODE]
        assert sorted(decode) == ["a", "b"]  # no step freezes the decoders
        chunks += [w.token_count for w in plan.work if w.sequence_id == "long"]
        # A step costs 16 ms plus 2 ms a token, learned from what "ran".
        scheduler.observe_iteration_duration(plan, 0.016 + 0.002 * plan.token_count)
        scheduler.complete_iteration(plan, sampling_predictions(plan))
        if sum(chunks) == 300:
            break
    assert chunks[0] == INITIAL_PREFILL_TOKENS
    assert chunks[2] == 90  # learned: (200 - 16 fixed - 2 rows * 2) / 2
    assert sum(chunks) == 300


def test_prompt_work_goes_to_the_oldest_admission_first():
    scheduler = make_scheduler(mixed_prefill_decode=True, target_step_us=200_000,
                               max_tokens_per_iteration=512, prefill_chunk_tokens=512)
    scheduler.submit(make_sequence("z-decoder", 2, max_tokens=50))
    run_step(scheduler)
    scheduler.submit(make_sequence("b-first", 64))
    scheduler.submit(make_sequence("a-second", 64))
    plan = scheduler.plan_iteration()
    prompt = [w.sequence_id for w in plan.work if w.phase is IterationPhase.PREFILL]
    assert prompt == ["b-first"]  # not sorted-id order: b was admitted first


def test_without_a_target_the_calibrated_mixing_stays():
    scheduler = make_scheduler(mixed_prefill_decode=True, max_tokens_per_iteration=512,
                               prefill_chunk_tokens=512)
    scheduler.submit(make_sequence("a", 4, max_tokens=50))
    run_step(scheduler)
    scheduler.submit(make_sequence("long", 300))
    plan = scheduler.plan_iteration()  # no decode baseline: phase-homogeneous prefill
    assert [w.phase for w in plan.work] == [IterationPhase.PREFILL]
    assert plan.work[0].token_count == 300
