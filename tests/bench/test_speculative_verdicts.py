"""bench/speculative.py: which target each cell is held to."""

from __future__ import annotations

import pytest
from bench_script import loaded


@pytest.fixture(scope="module")
def spec():
    with loaded("speculative") as module:
        yield module


def _cells(spec):
    return {("copy", 1): spec.Cell(tok_s={"skippyd ngram": [12.0], "skippyd off": [10.0]}),
            ("free", 1): spec.Cell(tok_s={"skippyd ngram": [9.7], "skippyd off": [10.0]})}


def test_the_copy_gain_is_asked_only_where_it_can_be_had(spec) -> None:
    rows = {r["workload"]: r for r in spec.verdicts(_cells(spec))}
    assert rows["copy"]["target"] == 1.3 and not rows["copy"]["met"]  # 1.2x is short of it
    assert rows["free"]["target"] == 0.98 and not rows["free"]["met"]  # 0.97x costs too much
    # Another model (random weights repeat nothing) or a split: the cost side only.
    rows = {r["workload"]: r for r in spec.verdicts(_cells(spec), gain_asked=False)}
    assert rows["copy"]["target"] == 0.98 and rows["copy"]["met"]
    assert rows["free"]["target"] == 0.98


def test_a_request_error_fails_the_cell(spec) -> None:
    cells = _cells(spec)
    cells[("copy", 1)].errors = 1
    (copy,) = [r for r in spec.verdicts(cells, gain_asked=False) if r["workload"] == "copy"]
    assert copy["ratio"] == pytest.approx(1.2) and not copy["met"]
