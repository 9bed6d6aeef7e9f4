"""The step-time budget: learned costs, prompt chunks sized to keep decoders moving."""

from __future__ import annotations

import pytest
from policy_helpers import make_scheduler, make_sequence, run_step, sampling_predictions

from skippyd.engine.policy import IterationPhase, IterationPlan, IterationWork
from skippyd.engine.policy.planning import even_chunk, plan_budgeted, prompt_order
from skippyd.engine.policy.step_budget import (
    BURST_PROMPTS,
    CHUNK_OVERRUN,
    EFFICIENT_CHUNK_STRETCH,
    EFFICIENT_PREFILL_TOKENS,
    INITIAL_PREFILL_TOKENS,
    MAX_TARGET_STRETCH,
    MIN_PREFILL_TOKENS,
    StepCostModel,
    TargetStretch,
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
    assert costs.prefill_budget(4, 500_000, 2000) == 92  # (500 - 20 fixed - 4 * 5) / 5
    assert costs.prefill_budget(4, 500_000, 10) == 10
    assert costs.prefill_budget(4, 50_000, 2000) == MIN_PREFILL_TOKENS  # prompts still move


def test_a_chunk_too_small_to_run_at_full_speed_is_rounded_up_within_twice_the_target():
    costs = StepCostModel()
    costs.observe(plan_of(4, 0), 0.040)
    costs.observe(plan_of(4, 100), 0.540)  # 5 ms a token beside 20 ms fixed
    efficient_step_ms = 20 + 5 * (4 + EFFICIENT_PREFILL_TOKENS)  # 365 ms
    # 200 ms leaves room for 32 tokens; 65 take 365 ms, within twice the target.
    assert costs.prefill_budget(4, 200_000, 2000) == EFFICIENT_PREFILL_TOKENS
    edge = int(efficient_step_ms * 1000 / EFFICIENT_CHUNK_STRETCH)
    assert costs.prefill_budget(4, edge + 500, 2000) == EFFICIENT_PREFILL_TOKENS
    # Past twice the target the small chunk stays: the streams' gap comes first.
    assert costs.prefill_budget(4, edge - 500, 2000) == (edge - 500 - 40_000) // 5000
    assert costs.prefill_budget(4, 200_000, 40) == 40  # never more than the plan holds


def test_the_target_is_at_least_a_few_decode_steps_of_the_model_at_hand():
    costs = StepCostModel()
    assert costs.step_target_us(8, 250_000, 4) == 250_000  # nothing learned yet
    costs.observe(plan_of(8, 0), 0.040)
    costs.observe(plan_of(8, 100), 0.540)  # a small model: 5 ms a token, 0 fixed
    assert costs.step_target_us(8, 250_000, 4) == 250_000  # 4 x 40 ms is less
    assert costs.step_target_us(0, 250_000, 4) == 250_000
    slow = StepCostModel()
    slow.observe(plan_of(8, 0), 0.165)
    slow.observe(plan_of(8, 64), 1.125)  # a compute-bound one: 15 ms a token, 45 fixed
    target = slow.step_target_us(8, 250_000, 4)
    assert target == pytest.approx(4 * 165_000)
    assert slow.step_target_us(8, 250_000, 0) == 250_000  # the floor off
    # At a fixed 250 ms the 8 rows' 165 ms left room for 5 prompt tokens (16, the
    # least); at the model's own target a chunk runs at full speed.
    assert slow.prefill_budget(8, 250_000, 2048) == MIN_PREFILL_TOKENS
    assert slow.prefill_budget(8, target, 2048) >= EFFICIENT_PREFILL_TOKENS


def slow_model_chunks(target_decode_steps: float) -> tuple[list[int], int]:
    """The chunks of a 600-token prompt beside 8 decoders on a model whose step takes
    45 ms plus 15 ms a token (8 decode rows alone: 165 ms), at a 250 ms target; and the
    step target the status shows at the end."""
    scheduler = make_scheduler(mixed_prefill_decode=True, target_step_us=250_000,
                               target_decode_steps=target_decode_steps,
                               max_tokens_per_iteration=2048, prefill_chunk_tokens=2048,
                               max_active_sequences=16)
    decoders = [f"d{i}" for i in range(8)]
    for name in decoders:
        scheduler.submit(make_sequence(name, 4, max_tokens=500))
    run_step(scheduler)
    run_step(scheduler)
    scheduler.submit(make_sequence("long", 600, max_tokens=4))
    chunks = []
    target = 0
    for _ in range(60):
        plan = scheduler.plan_iteration()
        decode = [w.sequence_id for w in plan.work if w.phase is IterationPhase.DECODE]
        assert sorted(decode) == decoders
        chunks += [w.token_count for w in plan.work if w.sequence_id == "long"]
        target = scheduler.step_target_us
        scheduler.observe_iteration_duration(plan, 0.045 + 0.015 * plan.token_count)
        scheduler.complete_iteration(plan, sampling_predictions(plan))
        if sum(chunks) == 600:
            break
    assert sum(chunks) == 600
    return chunks, target


def test_a_slow_model_s_steps_carry_prompt_chunks_it_runs_at_full_speed():
    chunks, target = slow_model_chunks(4)
    # Once the costs are learned, every chunk runs at full speed (64 or more tokens).
    assert min(chunks[2:]) >= EFFICIENT_PREFILL_TOKENS - 1
    assert target == pytest.approx(4 * 165_000, rel=0.01)  # what the status shows
    # With the target alone, 8 decode rows leave room for the least chunk only.
    chunks, target = slow_model_chunks(0)
    assert max(chunks[2:]) < EFFICIENT_PREFILL_TOKENS - 1
    assert target == 250_000


def test_decoders_get_a_row_every_step_while_a_long_prompt_is_chunked():
    scheduler = make_scheduler(mixed_prefill_decode=True, target_step_us=200_000,
                               max_tokens_per_iteration=512, prefill_chunk_tokens=512,
                               max_active_sequences=4)
    for name in ("a", "b"):
        scheduler.submit(make_sequence(name, 4, max_tokens=50))
    run_step(scheduler)  # both prompts whole: nobody was decoding
    run_step(scheduler)  # a decode step: no prompt is pending any more
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
    assert chunks[0] == even_chunk(300, INITIAL_PREFILL_TOKENS)
    # Learned: (200 - 16 fixed - 2 rows * 2) / 2 = 90 tokens a step; the rest of the
    # prompt goes in as few equal chunks as that allows, with no small last one.
    assert scheduler.step_costs.prefill_budget(2, 200_000, 512) == 90
    rest = chunks[2:]
    assert max(rest) - min(rest) <= 1 and max(rest) <= int(90 * CHUNK_OVERRUN)
    assert len(rest) == -(-sum(rest) // int(90 * CHUNK_OVERRUN))
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
    assert scheduler.step_target_us == 0
    assert [w.phase for w in plan.work] == [IterationPhase.PREFILL]
    assert plan.work[0].token_count == 300


def test_the_target_stretches_with_the_prompts_that_queue_up():
    stretch = TargetStretch()
    assert [stretch.factor(n) for n in (0, 1, 0, 1)] == [1, 1, 1, 1]  # one at a time
    assert stretch.factor(3) == 3
    assert stretch.factor(50) == MAX_TARGET_STRETCH
    # Once prompts queued, a lone pending prompt still gets twice the target ...
    assert [stretch.factor(n) for n in (1, 1)] == [2, 2]
    # ... until the queue is empty once.
    assert [stretch.factor(n) for n in (0, 1)] == [1, 1]


def streaming_scheduler(*decoders: str):
    """A 200 ms step target, ``decoders`` decoding, and one step to run a plan that
    "takes" 16 ms plus 2 ms a token (so the costs are learned)."""
    scheduler = make_scheduler(mixed_prefill_decode=True, target_step_us=200_000,
                               max_tokens_per_iteration=2048, prefill_chunk_tokens=2048,
                               max_active_sequences=8)
    for name in decoders:
        scheduler.submit(make_sequence(name, 4, max_tokens=500))
    run_step(scheduler)
    run_step(scheduler)  # a decode step: no prompt is pending any more

    def step(plan):
        scheduler.observe_iteration_duration(plan, 0.016 + 0.002 * plan.token_count)
        scheduler.complete_iteration(plan, sampling_predictions(plan))

    return scheduler, step


def prompt_rows(plan) -> dict[str, int]:
    return {w.sequence_id: w.token_count for w in plan.work
            if w.phase is not IterationPhase.DECODE}


def test_queued_prompts_get_bigger_chunks_and_the_first_one_gets_them():
    scheduler, step = streaming_scheduler("a", "b")
    scheduler.submit(make_sequence("first", 1000, max_tokens=4))
    done = 0
    for _ in range(3):  # learn the costs with one prompt pending
        step(plan := scheduler.plan_iteration())
        done += prompt_rows(plan)["first"]
    # (200 - 16 fixed - 2 rows * 2) / 2 = 90 a step, in equal chunks.
    assert prompt_rows(plan) == {"first": even_chunk(1000 - done + prompt_rows(plan)["first"], 90)}
    scheduler.submit(make_sequence("second", 1000, max_tokens=4))
    scheduler.submit(make_sequence("third", 1000, max_tokens=4))
    plan = scheduler.plan_iteration()
    decode = sorted(w.sequence_id for w in plan.work if w.phase is IterationPhase.DECODE)
    assert decode == ["a", "b"]  # the streams still get their row
    # Three pending: (600 - 16 - 2 * 2) / 2 = 290, all to the oldest.
    assert prompt_rows(plan) == {"first": even_chunk(1000 - done, 290)}
    assert scheduler.step_target_us == 600_000  # what the status shows
    while set(prompt_rows(plan)) != {"third"}:
        step(plan)
        plan = scheduler.plan_iteration()
    rows = sum(1 for w in plan.work if w.phase is IterationPhase.DECODE)
    # Alone now, but the queue was not empty since: twice the target.
    third = next(w for w in plan.work if w.sequence_id == "third")
    assert prompt_rows(plan) == {"third": even_chunk(1000 - third.positions[0],
                                                     (400 - 16 - 2 * rows) // 2)}


def test_a_prompt_the_budget_cannot_finish_is_cut_into_equal_chunks():
    assert even_chunk(60, 80) == 60  # it finishes
    # Six chunks of 84 (an eighth over the budget at most), not six of 80 and one of 24.
    assert CHUNK_OVERRUN == 1.125
    assert even_chunk(504, 80) == 84
    assert even_chunk(500, 80) == 84  # the last one 80
    assert even_chunk(640, 80) == 80  # 8 chunks either way: no overrun
    assert even_chunk(700, 80) == 88  # 8 chunks, not 9
    assert even_chunk(100, 90) == 100  # ten tokens over the budget save a chunk
    # Never below the efficient chunk when the budget reaches it.
    assert even_chunk(130, 100) == EFFICIENT_PREFILL_TOKENS
    assert even_chunk(504, EFFICIENT_PREFILL_TOKENS) == 72  # 7 of 72, not 7 of 65 and 49
    assert even_chunk(100, 40) == 34  # a budget below it keeps its own size
    scheduler, step = streaming_scheduler("a", "b")
    scheduler.submit(make_sequence("long", 1000, max_tokens=4))
    scheduler.submit(make_sequence("next", 1000, max_tokens=4))
    chunks = []
    while len(chunks) < 30:
        plan = scheduler.plan_iteration()
        rows = prompt_rows(plan)
        chunks.append(rows["long"])
        if sum(chunks) == 1000:  # the last chunk: what it leaves goes to the next one
            break
        # What a chunk leaves of the budget is not given to the next prompt.
        assert set(rows) == {"long"}
        step(plan)
    # Once the costs are known, with two long prompts pending (twice the target):
    # (400 - 16 fixed - 2 rows * 2) / 2 = 190 tokens a step at most, in equal chunks.
    learned = chunks[3:]
    assert max(learned) <= int(190 * CHUNK_OVERRUN) and max(learned) - min(learned) <= 1


def test_a_short_prompt_beside_a_long_one_does_not_stretch_the_target():
    scheduler, step = streaming_scheduler("a")
    scheduler.submit(make_sequence("long", 1000, max_tokens=4))
    for _ in range(3):  # learn the costs
        step(scheduler.plan_iteration())
    scheduler.submit(make_sequence("short", 40, max_tokens=4))
    plan = scheduler.plan_iteration()
    # (200 - 16 - 1 row * 2) / 2: one target; the short prompt fits in a step.
    assert sum(prompt_rows(plan).values()) == 91


def test_a_short_prompt_goes_ahead_of_a_long_one_and_finishes_in_one_step():
    scheduler, step = streaming_scheduler("a")
    scheduler.submit(make_sequence("long", 1000, max_tokens=4))
    for _ in range(3):  # learn the costs
        step(scheduler.plan_iteration())
    scheduler.submit(make_sequence("restart", 40, max_tokens=4))  # a stream restarting
    plan = scheduler.plan_iteration()
    prompts = [w.sequence_id for w in plan.work if w.phase is IterationPhase.PREFILL]
    assert prompts == ["restart", "long"]
    assert prompt_rows(plan) == {"restart": 40, "long": 91 - 40}
    step(plan)
    plan = scheduler.plan_iteration()
    decode = sorted(w.sequence_id for w in plan.work if w.phase is IterationPhase.DECODE)
    assert decode == ["a", "restart"]  # decoding one step after it arrived


def test_short_prompts_leave_the_oldest_prompt_its_minimum_share():
    scheduler, step = streaming_scheduler("a")
    scheduler.submit(make_sequence("long", 1000, max_tokens=4))
    for _ in range(3):  # learn the costs
        step(scheduler.plan_iteration())
    for name in ("s1", "s2"):  # together more than the step holds
        scheduler.submit(make_sequence(name, 40, max_tokens=4))
    plan = scheduler.plan_iteration()
    rows = prompt_rows(plan)
    # s1 fits beside the reserve, s2 does not and keeps its place after the long one.
    assert [w.sequence_id for w in plan.work if w.phase is IterationPhase.PREFILL][0] == "s1"
    assert rows["s1"] == 40 and rows["long"] >= MIN_PREFILL_TOKENS
    assert sum(rows.values()) == 91


def test_the_prompt_order_promotes_nothing_when_one_prompt_a_step_is_allowed():
    by_admission = [make_sequence("long", 500), make_sequence("short", 10)]
    assert [s.id for s in prompt_order(by_admission, 100, 16, 8)] == ["short", "long"]
    assert [s.id for s in prompt_order(by_admission, 100, 16, 1)] == ["long", "short"]
    assert [s.id for s in prompt_order(by_admission, 20, 16, 8)] == ["long", "short"]


def test_a_burst_of_short_prompts_is_taken_in_large_steps():
    scheduler, step = streaming_scheduler("a")
    scheduler.submit(make_sequence("warm", 1000, max_tokens=4))
    for _ in range(3):  # learn the costs
        step(scheduler.plan_iteration())
    scheduler.cancel("warm")
    step(scheduler.plan_iteration())  # nothing pending now
    for name in ("p1", "p2"):
        scheduler.submit(make_sequence(name, 80, max_tokens=4))
    plan = scheduler.plan_iteration()
    # Two short ones: one target (91 tokens), which holds p1 whole; p2 is not cut.
    assert prompt_rows(plan) == {"p1": 80}
    step(plan)
    for name in ("p3", "p4", "p5", "p6"):
        scheduler.submit(make_sequence(name, 80, max_tokens=4))
    plan = scheduler.plan_iteration()
    rows = sum(1 for w in plan.work if w.phase is IterationPhase.DECODE)
    # Five pending at once (5 * 80): a burst, four targets (the most), which hold four of
    # them whole; the fifth waits for the next step rather than being cut.
    assert 320 <= (800 - 16 - 2 * rows) // 2 < 400
    assert prompt_rows(plan) == {"p2": 80, "p3": 80, "p4": 80, "p5": 80}
    assert scheduler.step_target_us == 800_000


def test_a_later_prompt_the_step_could_hold_whole_is_not_cut():
    by_admission = [make_sequence(name, tokens) for name, tokens in
                    (("first", 60), ("second", 60), ("third", 30))]
    config = make_scheduler().config
    work, _ = plan_budgeted(by_admission, by_admission, config, 100, 0)
    # "second" would fit in a step of 100 but not in the 40 left: it waits whole, and
    # "third" takes the room.
    assert {w.sequence_id: w.token_count for w in work} == {"first": 60, "third": 30}


def test_the_oldest_prompt_not_promoted_keeps_its_reserve():
    # Budget 100 with a reserve of 16: "first" (60) is promoted; "older" (90) fits in the
    # step but not beside the reserve, so it is not promoted. Being the oldest, it still
    # takes what is left instead of waiting behind every newcomer that is promoted.
    by_admission = [make_sequence("older", 90), make_sequence("first", 60)]
    order = prompt_order(by_admission, 100, 16, 8)
    assert [s.id for s in order] == ["first", "older"]
    config = make_scheduler(prefill_chunk_tokens=512).config
    work, _ = plan_budgeted(by_admission, order, config, 100, 0, oldest_prompt="older")
    assert {w.sequence_id: w.token_count for w in work} == {"first": 60, "older": 40}


def test_a_long_prompt_still_takes_what_a_step_leaves():
    by_admission = [make_sequence("short", 60), make_sequence("long", 500)]
    config = make_scheduler(prefill_chunk_tokens=512).config
    work, _ = plan_budgeted(by_admission, by_admission, config, 100, 0)
    assert {w.sequence_id: w.token_count for w in work} == {"short": 60, "long": 40}


def test_a_burst_is_three_short_prompts_and_stretches_only_while_it_lasts():
    assert BURST_PROMPTS == 3
    stretch = TargetStretch()
    assert stretch.factor(0, short_prompts=2) == 1
    assert stretch.factor(1, short_prompts=2) == 1  # a long prompt and two restarts
    assert stretch.factor(1, short_prompts=3) == 3
    assert stretch.factor(1, short_prompts=0) == 1  # not sticky, unlike long queues


def _chunks(plan: IterationPlan) -> list[tuple[str, int, bool]]:
    return [(w.sequence_id, w.token_count, w.sample_last) for w in plan.work
            if w.phase is not IterationPhase.DECODE]


@pytest.mark.parametrize("target_step_us", [0, 250_000])
def test_a_sampled_prompt_end_goes_in_a_chunk_of_its_own(target_step_us):
    # Stage 0 of a split pipeline: the chunk that samples is the last 8 tokens, planned
    # the step after the rest; a prompt too short to cut samples whole.
    scheduler = make_scheduler(sample_tail_tokens=8, target_step_us=target_step_us,
                               mixed_prefill_decode=True)
    scheduler.submit(make_sequence("long", 61))
    scheduler.submit(make_sequence("short", 15))
    plan, _ = run_step(scheduler)
    assert _chunks(plan) == [("long", 53, False), ("short", 15, True)]
    plan, _ = run_step(scheduler)
    assert _chunks(plan) == [("long", 8, True)]
    assert [w.phase for w in plan.work].count(IterationPhase.DECODE) == (
        1 if target_step_us else 0)


def test_the_held_back_tail_is_not_handed_to_another_prompt():
    scheduler = make_scheduler(sample_tail_tokens=8, max_tokens_per_iteration=64,
                               prefill_chunk_tokens=64)
    for name in ("a", "b"):
        scheduler.submit(make_sequence(name, 64))
    plan, _ = run_step(scheduler)
    # 56 of "a"; its last 8 are spent in this plan, not given to a chunk of "b".
    assert _chunks(plan) == [("a", 56, False)]


def test_without_a_tail_the_prompt_samples_in_its_last_chunk():
    scheduler = make_scheduler()
    scheduler.submit(make_sequence("p", 61))
    plan, _ = run_step(scheduler)
    assert _chunks(plan) == [("p", 61, True)]
