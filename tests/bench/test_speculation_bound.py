"""bench/speculation_bound.py: the drafter replayed over an answer, the oracle's draft
lengths, and one tiny run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_script import BENCH_DIR, loaded


@pytest.fixture(scope="module")
def sb():
    with loaded("speculation_bound") as module:
        yield module


def test_the_drafter_replayed_over_an_answer_counts_what_it_would_accept(sb) -> None:
    prompt = [10, 11, 12, 13, 14, 15]
    answer = [10, 11, 12, 13, 20, 21]
    # After "10 11" the drafter copies "12 13 14 15" from the prompt: two survive.
    assert sb.accepted_drafts(prompt, answer, 16) == [0, 2, 1, 0, 0]
    assert sb.accepted_drafts(prompt, answer, 1) == [0, 1, 1, 0, 0]


def test_the_oracle_drafts_where_it_pays_and_never_loses_to_plain_decoding(sb) -> None:
    accepted = [0, 2, 1, 0, 0]
    costs = [1.0, 1.5, 2.0, 2.5]  # c(1)..c(4)
    # One plain step, one with two drafts (both kept: three tokens for 2.0), one plain.
    assert sb.oracle(accepted, costs, 3) == (4.0, 3, 2, 2)
    # Where a row costs more than a step, drafting never pays.
    assert sb.oracle(accepted, [1.0, 2.1, 3.2, 4.3], 3) == (5.0, 5, 0, 0)


def test_a_rule_without_foresight_pays_for_the_drafts_it_loses(sb) -> None:
    found = sb.proposals([10, 11, 12, 13, 14, 15], [10, 11, 12, 13, 20, 21], 16)
    assert [(p.drafts, p.match, p.accepted) for p in found] == [
        (0, 0, 0), (6, 2, 2), (6, 2, 1), (6, 4, 0), (0, 0, 0)]
    costs = [1.0 + 0.5 * k for k in range(7)]
    # Whole proposals: plain, then six drafts (two kept: 4.0 for three tokens), then plain.
    assert sb.follow(sb.RULES["every proposal, whole"], found, costs) == (6.0, 3, 6, 2)
    # Only 8-token matches: none here, so plain decoding.
    assert sb.follow(sb.RULES["8-token matches only"], found, costs) == (5.0, 5, 0, 0)


def test_what_a_policy_sees_is_the_match_the_drafts_kept_in_a_row_and_the_last_step(
        sb) -> None:
    p = sb.Proposal(drafts=6, match=8, accepted=3)
    assert sb.situation(p, []) == (8, 0, 0)
    assert sb.situation(p, [(0, 0)]) == (8, 0, 1)
    # Two fully kept steps after a plain one: 4 + 5 kept in a row.
    assert sb.situation(p, [(0, 0), (4, 4), (5, 5)]) == (8, 2, 2)
    # A step that lost drafts ends the run with what it kept.
    assert sb.situation(p, [(4, 4), (6, 2)]) == (8, 1, 3)
    assert sb.situation(p, [(16, 16), (16, 16)]) == (8, 3, 2)


def test_the_fitted_table_drafts_where_drafts_are_kept_and_not_where_they_are_lost(sb) -> None:
    # Two kinds of proposals: 8-token matches that are always kept whole, 2-token matches
    # that are never kept. Rows are cheap (a draft costs a tenth of a step).
    good = [sb.Proposal(4, 8, 4)] * 20
    bad = [sb.Proposal(4, 2, 0)] * 20
    costs = [1.0 + 0.1 * k for k in range(5)]
    table, seconds = sb.fit_table([good, bad], costs, 4)
    assert set(table) and all(key[0] == 8 for key in table)
    plain = sum(sb.follow(lambda p, h: 0, found, costs)[0] for found in (good, bad))
    assert seconds < plain
    # Where a draft costs more than a step, the best table is to draft nothing.
    table, seconds = sb.fit_table([good, bad], [1.0 + 1.5 * k for k in range(5)], 4)
    assert table == {} and seconds == plain


def test_skippyd_s_control_drafts_runs_that_are_kept_where_rows_are_cheap(sb) -> None:
    good = [sb.Proposal(4, 8, 4)] * 20
    costs = [1.0 + 0.1 * k for k in range(5)]
    rule = sb.ControlRule(costs, 2, 4)
    seconds, steps, drafted, accepted = sb.follow(rule, good, costs)
    assert accepted == drafted > 0 and seconds < 20 * costs[0]
    # Runs that are never kept: it tries them again now and then (rows are cheap here),
    # in a quarter of the steps at most, where every proposal whole would be 160 drafts.
    bad = [sb.Proposal(4, 8, 0)] * 40
    _, steps, drafted, accepted = sb.follow(rule, bad, costs)
    assert accepted == 0 and steps == 40 and drafted <= 40


def test_a_tiny_run_reports_row_costs_and_a_bound_of_at_least_one(sb, tiny_model_path: Path,
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "bound.json"
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / "speculation_bound.py"), "--model",
         str(tiny_model_path), "--threads", "1", "--prompts", "2", "--max-tokens", "12",
         "--max-draft", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=180, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())
    assert len(figures["row_cost_ms"]) == 4 and all(c > 0 for c in figures["row_cost_ms"])
    assert len(figures["answers"]) == 2
    for answer in figures["answers"]:
        assert 1 <= answer["tokens"] <= 12 and answer["prefill_s"] > 0
        # Drafting nothing is one of the oracle's choices: it is never slower than plain.
        assert answer["oracle_s"] <= answer["plain_s"] + 1e-12 and answer["ratio"] >= 1.0
    assert figures["perfect_drafter_ratio"] >= 1.0
    assert "a drafter that is always right" in result.stdout
    assert set(figures["rules"]) == {"every proposal, whole", "8-token matches only",
                                     "after a fully kept step", sb.CONTROL_RULE,
                                     sb.TABLE_RULE}
    # A policy without foresight never beats the oracle, and the fitted table never
    # loses to drafting nothing (its starting point).
    total = figures["total"]
    table = figures["rules"][sb.TABLE_RULE]
    assert total["oracle_s"] <= table["oracle_s"] + 1e-9 <= total["plain_s"] + 2e-9
