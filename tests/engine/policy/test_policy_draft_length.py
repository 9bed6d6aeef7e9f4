"""Speculative decoding's pure parts: n-gram drafts, acceptance, and the draft length
that pays for its rows."""

from __future__ import annotations

import pytest

from skippyd.engine.policy import IterationPhase, IterationPlan, IterationWork
from skippyd.engine.policy.draft_length import DraftControl, Survival, expected_tokens
from skippyd.engine.policy.ngram import NgramIndex
from skippyd.engine.policy.step_budget import StepCostModel


def indexed(tokens: list[int]) -> NgramIndex:
    index = NgramIndex()
    index.extend(tokens)
    return index


# -- n-gram drafts -----------------------------------------------------------------------

def test_a_run_seen_before_proposes_what_followed_it():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    assert indexed(text).propose(4) == ((4, 5, 6, 7), 2)


def test_the_longest_run_found_again_wins_over_a_later_shorter_one():
    # [7, 8] is followed by 9 early on and by 5 later; after 5, 6, 7, 8 only the first
    # place matches four tokens.
    text = [5, 6, 7, 8, 9, 9, 1, 7, 8, 5, 5, 2, 5, 6, 7, 8]
    assert indexed(text).propose(2) == ((9, 9), 4)


def test_the_latest_place_wins_among_equal_matches():
    text = [3, 4, 1, 3, 4, 2, 3, 4]
    assert indexed(text).propose(1) == ((2,), 2)


def test_nothing_seen_before_proposes_nothing():
    assert indexed([1, 2, 3, 4, 5]).propose(4) == ((), 0)
    assert indexed([1]).propose(4) == ((), 0)
    assert indexed([1, 2, 1, 2]).propose(0) == ((), 0)


def test_growing_the_index_token_by_token_equals_building_it_at_once():
    text = [1, 2, 3, 1, 2, 3, 4, 1, 2, 3, 4, 5, 1, 2]
    grown = NgramIndex()
    for token in text:
        grown.extend([token])
    assert grown.propose(3) == indexed(text).propose(3) == ((3, 4, 5), 2)
    assert len(grown) == len(text)


# -- how far drafts survive --------------------------------------------------------------

def test_survival_counts_only_the_drafts_put_to_the_test():
    survival = Survival(depth=6, memory=1.0)
    survival.record(drafted=6, accepted=2)  # two kept, the third missed, three untested
    assert survival.tried == [1, 1, 1, 0, 0, 0]
    assert survival.accepted == [1, 1, 0, 0, 0, 0]
    survival.record(drafted=3, accepted=3)  # all kept: nothing beyond them tested
    assert survival.tried == [2, 2, 2, 0, 0, 0]
    chances = survival.chances()
    assert chances[0] > chances[2]
    # Where nothing is known, a depth starts from the chance just before it.
    assert chances[3] == pytest.approx(chances[2]) and chances[5] == pytest.approx(chances[2])


def test_a_new_request_starts_from_what_drafts_of_its_kind_get_lately():
    control = DraftControl(min_draft=2, max_draft=8)
    neutral = control.chances(control.new_stats(), 8)
    veteran = control.new_stats()
    for _ in range(30):
        control.record(veteran, 8, drafted=6, accepted=6)
        control.record(veteran, 2, drafted=6, accepted=0)
    long_match = control.chances(control.new_stats(), 8)
    short_match = control.chances(control.new_stats(), 2)
    assert long_match[0] > 0.95 and short_match[0] < neutral[0] - 0.5


def test_a_kind_of_draft_that_failed_is_tried_again_once_the_stage_went_long_without():
    control = DraftControl(min_draft=2, max_draft=8)
    stats = control.new_stats()
    for _ in range(30):
        control.record(stats, 2, drafted=6, accepted=0)
    failed = control.chances(control.new_stats(), 2)[0]
    for _ in range(2000):
        control.note_plain_step(stats, 1)
    assert control.chances(control.new_stats(), 2)[0] > failed + 0.3


def test_a_request_that_stopped_drafting_drifts_back_towards_trying_again():
    control = DraftControl(min_draft=2, max_draft=8)
    stats = control.new_stats()
    for _ in range(10):
        control.record(stats, 2, drafted=4, accepted=0)
    low = control.chances(stats, 2)[0]
    for _ in range(40):
        control.note_plain_step(stats, 1)
    assert control.chances(stats, 2)[0] > low
    assert (stats.num_drafted, stats.num_accepted) == (40, 0)


def test_expected_tokens_adds_the_chance_each_draft_survives():
    assert expected_tokens([0.0] * 5, 5) == 1.0
    assert expected_tokens([1.0] * 5, 5) == 6.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_tokens([0.2, 1.0, 1.0], 3) == pytest.approx(1.6)  # a run, or nothing


# -- draft length ------------------------------------------------------------------------

def decode_plan(rows: int) -> IterationPlan:
    work = [IterationWork(f"s{i}", (1,), (10,), True, IterationPhase.DECODE) for i in range(rows)]
    return IterationPlan(work=work, token_count=rows)


def taught(fixed_ms: float, per_row_ms: float) -> DraftControl:
    """A control whose decode steps cost ``fixed + per_row * rows``."""
    control = DraftControl(min_draft=2, max_draft=8)
    for rows in (1, 3, 5, 9, 2, 7):
        control.observe(decode_plan(rows), (fixed_ms + per_row_ms * rows) / 1000)
    return control


def test_a_step_bound_by_its_fixed_cost_drafts_even_at_modest_acceptance():
    control = taught(fixed_ms=11.0, per_row_ms=1.0)  # a small model, one stream
    assert control.draft_length([0.8] * 8, decode_rows=1, step_rows=1, available=8) == 8
    assert control.draft_length([0.3] * 8, decode_rows=1, step_rows=1, available=8) >= 2


def test_compute_bound_rows_or_poor_acceptance_draft_nothing():
    compute_bound = taught(fixed_ms=5.0, per_row_ms=17.0)  # a 1B model on two cores
    assert compute_bound.draft_length([0.6] * 8, decode_rows=1, step_rows=1, available=8) == 0
    full_batch = taught(fixed_ms=11.0, per_row_ms=1.0)
    assert full_batch.draft_length([0.3] * 8, decode_rows=64, step_rows=64, available=8) == 0
    assert taught(11.0, 1.0).draft_length([0.02] * 8, decode_rows=1, step_rows=1,
                                          available=8) == 0


def test_a_run_that_usually_fails_at_its_first_draft_is_not_tried():
    control = taught(fixed_ms=6.0, per_row_ms=5.0)  # rows as dear as on a 2-core CPU
    assert control.draft_length([0.25] + [0.99] * 7, 1, 1, 8) == 0
    assert control.draft_length([0.97] * 8, 1, 1, 8) == 8


def test_once_drafting_pays_a_draft_must_pay_at_its_rate_not_at_plain_decoding_s():
    control = taught(fixed_ms=6.0, per_row_ms=5.0)  # a draft costs half a plain step
    # A run that survives at 0.6 a depth: the first draft pays at plain decoding's rate
    # (0.6 tokens for 0.45 of a step's cost)...
    marginal = [0.6] * 8
    assert control.rate == 1.0
    assert control.draft_length(marginal, 1, 1, 8) >= 2
    # ...but not once drafting yields more per row's cost: whole runs of 8 kept.
    stats = control.new_stats()
    for _ in range(20):
        control.draft_length([0.99] * 8, 1, 1, 8, stats=stats)
        control.record(stats, 8, drafted=8, accepted=8)
    assert control.rate > 1.5
    assert control.draft_length(marginal, 1, 1, 8) == 0
    assert control.draft_length([0.99] * 8, 1, 1, 8) == 8
    # Plain rows bring the rate back towards one token per row.
    for _ in range(200):
        control.note_plain_step(stats, 1)
    assert control.rate < 1.05
    assert control.draft_length(marginal, 1, 1, 8) >= 2


def test_each_row_is_charged_the_price_its_own_length_was_chosen_at():
    control = taught(fixed_ms=6.0, per_row_ms=5.0)
    alone, crowded = control.new_stats(), control.new_stats()
    # In a step of 8 decode rows a draft costs more of the step's tokens.
    control.draft_length([0.99] * 8, 8, 8, 8, stats=crowded)
    control.draft_length([0.99] * 8, 1, 1, 8, stats=alone)
    assert alone.price == pytest.approx(5 / 11)
    assert crowded.price == pytest.approx(5 * 8 / 46)
    # The crowded row, all 8 kept, counts 9 tokens for 1 + 8 of its own prices, not of
    # the price chosen last (the rate starts from one token for one).
    control.record(crowded, 8, drafted=8, accepted=8)
    assert control.rate == pytest.approx((9 + 1) / (1 + 8 * 40 / 46 + 1))


def test_drafts_stay_within_what_is_offered_and_the_minimum():
    control = taught(fixed_ms=11.0, per_row_ms=1.0)
    assert control.draft_length([0.9] * 8, decode_rows=1, step_rows=1, available=3) == 3
    assert control.draft_length([0.9] * 8, decode_rows=1, step_rows=1, available=1) == 0


def test_before_decode_steps_tell_a_row_s_cost_the_policy_s_costs_are_used():
    control = DraftControl(min_draft=2, max_draft=8)
    assert control.draft_length([0.9] * 8, 1, 1, 8) == 0  # nothing known: no drafts
    policy_costs = StepCostModel()
    for tokens, ms in ((1, 12.0), (64, 76.0), (200, 212.0)):
        plan = IterationPlan(work=[IterationWork("p", (1,) * tokens, tuple(range(tokens)),
                                                 True, IterationPhase.PREFILL)],
                             token_count=tokens)
        policy_costs.observe(plan, ms / 1000)
    assert control.draft_length([0.9] * 8, 1, 1, 8, fallback=policy_costs) > 0


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="min_draft"):
        DraftControl(min_draft=4, max_draft=2)
