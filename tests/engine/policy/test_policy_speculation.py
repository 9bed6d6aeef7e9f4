"""Speculative decoding's pure parts: n-gram drafts, acceptance, and the draft length
that pays for its rows."""

from __future__ import annotations

import pytest

from skippyd.engine.policy import IterationPhase, IterationPlan, IterationWork
from skippyd.engine.policy.ngram import NgramIndex
from skippyd.engine.policy.speculation import DraftControl, DraftStats, expected_tokens
from skippyd.engine.policy.step_budget import StepCostModel


def indexed(tokens: list[int]) -> NgramIndex:
    index = NgramIndex()
    index.extend(tokens)
    return index


# -- n-gram drafts -----------------------------------------------------------------------

def test_a_run_seen_before_proposes_what_followed_it():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    assert indexed(text).propose(4) == (4, 5, 6, 7)


def test_the_longest_run_found_again_wins_over_a_later_shorter_one():
    # [7, 8] is followed by 9 early on and by 5 later; after 5, 6, 7, 8 only the first
    # place matches four tokens.
    text = [5, 6, 7, 8, 9, 9, 1, 7, 8, 5, 5, 2, 5, 6, 7, 8]
    assert indexed(text).propose(2) == (9, 9)


def test_the_latest_place_wins_among_equal_matches():
    text = [3, 4, 1, 3, 4, 2, 3, 4]
    assert indexed(text).propose(1) == (2,)


def test_nothing_seen_before_proposes_nothing():
    assert indexed([1, 2, 3, 4, 5]).propose(4) == ()
    assert indexed([1]).propose(4) == ()
    assert indexed([1, 2, 1, 2]).propose(0) == ()


def test_growing_the_index_token_by_token_equals_building_it_at_once():
    text = [1, 2, 3, 1, 2, 3, 4, 1, 2, 3, 4, 5, 1, 2]
    grown = NgramIndex()
    for token in text:
        grown.extend([token])
    assert grown.propose(3) == indexed(text).propose(3) == (3, 4, 5)
    assert len(grown) == len(text)


# -- acceptance --------------------------------------------------------------------------

def test_acceptance_counts_each_first_miss_as_a_trial():
    stats = DraftStats()
    prior = stats.acceptance
    stats.record(drafted=4, accepted=4)  # four accepted, no miss
    assert stats.acceptance > prior
    high = stats.acceptance
    stats.record(drafted=4, accepted=0)  # one miss (the rest were never put to the test)
    assert stats.acceptance < high
    assert (stats.num_drafted, stats.num_accepted) == (8, 4)


def test_a_request_that_stopped_drafting_drifts_back_towards_trying_again():
    stats = DraftStats()
    for _ in range(10):
        stats.record(drafted=4, accepted=0)
    low = stats.acceptance
    for _ in range(40):
        stats.note_plain_step(1)
    assert stats.acceptance > low


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


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
    assert control.draft_length(0.8, decode_rows=1, step_rows=1, available=8) == 8
    assert control.draft_length(0.3, decode_rows=1, step_rows=1, available=8) >= 2


def test_compute_bound_rows_or_poor_acceptance_draft_nothing():
    compute_bound = taught(fixed_ms=5.0, per_row_ms=17.0)  # a 1B model on two cores
    assert compute_bound.draft_length(0.6, decode_rows=1, step_rows=1, available=8) == 0
    full_batch = taught(fixed_ms=11.0, per_row_ms=1.0)
    assert full_batch.draft_length(0.3, decode_rows=64, step_rows=64, available=8) == 0
    assert taught(11.0, 1.0).draft_length(0.02, decode_rows=1, step_rows=1, available=8) == 0


def test_drafts_stay_within_what_is_offered_and_the_minimum():
    control = taught(fixed_ms=11.0, per_row_ms=1.0)
    assert control.draft_length(0.9, decode_rows=1, step_rows=1, available=3) == 3
    assert control.draft_length(0.9, decode_rows=1, step_rows=1, available=1) == 0


def test_before_decode_steps_tell_a_row_s_cost_the_policy_s_costs_are_used():
    control = DraftControl(min_draft=2, max_draft=8)
    assert control.draft_length(0.9, 1, 1, 8) == 0  # nothing known: no drafts
    policy_costs = StepCostModel()
    for tokens, ms in ((1, 12.0), (64, 76.0), (200, 212.0)):
        plan = IterationPlan(work=[IterationWork("p", (1,) * tokens, tuple(range(tokens)),
                                                 True, IterationPhase.PREFILL)],
                             token_count=tokens)
        policy_costs.observe(plan, ms / 1000)
    assert control.draft_length(0.9, 1, 1, 8, fallback=policy_costs) > 0


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="min_draft"):
        DraftControl(min_draft=4, max_draft=2)
