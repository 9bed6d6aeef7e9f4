"""The runtime overhead benchmark runs on a real llama.cpp context."""

from __future__ import annotations

from skippyd.bench.runtime import run_runtime_bench


def test_the_bare_loop_runs_on_lanes_the_runtime_used_before(smollm2_path):
    # The runtime keeps a finished session's cells in its lane for the prefix cache; the
    # bare loop decodes on those lanes next and must not trip over them.
    rows = run_runtime_bench(str(smollm2_path), threads=1, steps=4, rounds=2,
                             batches=(1, 2))
    assert [row.batch for row in rows] == [1, 2]
    assert all(row.skippyd_tok_s > 0 and row.bare_tok_s > 0 for row in rows)
