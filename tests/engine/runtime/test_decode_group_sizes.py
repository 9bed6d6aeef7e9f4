"""How stage 0 sizes a call's decode batches from what a step of each row count costs:
the partition whose chain cycle (every stage runs every batch; a batch passes every stage
before its next step) is shortest, more batches on a near tie, batches in flight
counted, and the step costs timed on the stage's own runtime."""

from __future__ import annotations

import pytest

from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.engine.runtime.pipeline_types import (
    GROUP_TIE,
    decode_group_sizes,
    lane_block_size,
)
from skippyd.engine.runtime.step_probe import time_decode_steps

#: One stage of the 1b shape on one core, timed (ms for 1..8 rows): four rows cost about
#: what three do, since the quantised kernels multiply four activation rows at a time.
TILED = (19.1, 34.9, 51.3, 56.5, 74.0, 92.2, 106.6, 111.5)
#: A step whose cost is a fixed part and a part per row.
LINEAR = tuple(5.0 + 2.0 * k for k in range(1, 9))


def cycle(sizes, table, stages=2, beside=()):
    costs = [table[n - 1] if n <= len(table) else table[-1] * n / len(table)
             for n in (*sizes, *beside)]
    return max(sum(costs), stages * max(costs))


def test_rows_go_in_whole_tiles_where_tiles_are_cheaper():
    assert decode_group_sizes(8, most=3, stages=2, step_ms=TILED) == [4, 4]
    assert decode_group_sizes(12, most=3, stages=2, step_ms=TILED) == [4, 4, 4]
    assert decode_group_sizes(7, most=3, stages=2, step_ms=TILED) == [3, 4]


def test_a_batch_whose_round_trip_bounds_the_cycle_is_cut():
    # [4, 2] costs less work than [2, 2, 2], but the 4-row batch must pass both stages
    # before its next step: 2 x 56.5 ms, longer than all of [2, 2, 2] (104.7 ms).
    assert decode_group_sizes(6, most=3, stages=2, step_ms=TILED) == [2, 2, 2]
    # With one stage more, a large batch's round trip weighs more.
    assert decode_group_sizes(8, most=4, stages=3, step_ms=TILED) == [2, 2, 2, 2]


def test_batches_in_flight_share_the_cycle():
    # Alone, four rows are best cut in two; beside a 4-row batch in flight they are the
    # second half of an [4, 4] cycle.
    assert decode_group_sizes(4, most=3, stages=2, step_ms=TILED) == [2, 2]
    assert decode_group_sizes(4, most=3, stages=2, step_ms=TILED, beside=[4]) == [4]
    assert decode_group_sizes(4, most=3, stages=2, step_ms=TILED, beside=[0, 4]) == [4]


def test_a_fixed_cost_per_step_means_few_batches():
    assert decode_group_sizes(8, most=3, stages=2, step_ms=LINEAR) == [4, 4]
    assert decode_group_sizes(16, most=3, stages=2, step_ms=LINEAR) == [8, 8]


def test_rows_beyond_the_table_cost_its_largest_steps_rate():
    # 24 rows: 8-row batches cost what the table says; 12-row ones 1.5 x 111.5 ms.
    assert decode_group_sizes(24, most=3, stages=2, step_ms=TILED) == [8, 8, 8]
    assert decode_group_sizes(24, most=2, stages=2, step_ms=TILED) == [12, 12]


@pytest.mark.parametrize("rows", range(1, 20))
@pytest.mark.parametrize("most", [1, 2, 3, 5])
@pytest.mark.parametrize("table", [TILED, LINEAR, (10.0,)])
def test_sizes_cover_the_rows_within_most_batches_near_the_best_cycle(rows, most, table):
    sizes = decode_group_sizes(rows, most=most, stages=2, step_ms=table)
    assert sum(sizes) == rows and all(n > 0 for n in sizes)
    assert len(sizes) <= max(1, min(most, rows)) and sizes == sorted(sizes)
    # No equal split into at most `most` batches cycles faster by more than the tie.
    for parts in range(1, min(most, rows) + 1):
        equal = [rows // parts + (1 if k < rows % parts else 0) for k in range(parts)]
        assert cycle(sizes, table) <= cycle(equal, table) * (1 + GROUP_TIE) + 1e-9


def test_no_rows_no_batches():
    assert decode_group_sizes(0, most=3, stages=2, step_ms=TILED) == []


def test_a_lane_block_is_the_step_with_the_least_cost_per_row():
    # 8 rows cost 13.9 ms a row against 4 rows' 14.1: within the tie, the smaller block.
    assert lane_block_size(16, stages=2, step_ms=TILED) == 4
    # Every stage needs a block of its own: 4 lanes over 2 stages make blocks of 2.
    assert lane_block_size(4, stages=2, step_ms=TILED) == 2
    # A fixed cost per step favours the largest step within reach.
    assert lane_block_size(16, stages=2, step_ms=LINEAR) == 8
    # Blocks tile the lanes: 12 lanes take blocks of 6 (7 and 8 would leave a ragged one).
    assert lane_block_size(12, stages=2, step_ms=LINEAR) == 6
    # 8 rows timed 6 % cheaper a row than 4 is within the noise of one timing each, and
    # the final stage's 8-row step (with the output head) costs more: still blocks of 4.
    assert lane_block_size(16, stages=2, step_ms=(19, 35, 51, 60, 74, 92, 106, 113)) == 4
    # Clearly cheaper (15 %): blocks of 8.
    assert lane_block_size(16, stages=2, step_ms=(19, 35, 51, 60, 74, 92, 106, 102)) == 8
    # A noisy timing that makes 5 rows look cheapest still gives blocks that tile 16.
    assert lane_block_size(16, stages=2, step_ms=(26, 50, 64, 66, 70, 109, 128, 141)) == 4
    assert lane_block_size(1, stages=2, step_ms=TILED) == 1
    assert lane_block_size(16, stages=2, step_ms=()) == 1


def test_step_costs_are_timed_on_the_runtime_and_leave_nothing_behind(tiny_model_path):
    runtime = LlamaRuntime(RuntimeOptions(str(tiny_model_path), lane_count=4, ctx_size=256,
                                          threads=1, final_stage=False))
    try:
        costs = time_decode_steps(runtime, 8)
        assert len(costs) == 4  # no more rows than lanes
        assert all(ms > 0 for ms in costs)
        assert runtime.active_session_count() == 0 and runtime.kv_cells_used() == 0
        assert runtime.idle_lanes() == [0, 1, 2, 3]
        assert len(time_decode_steps(runtime, 2)) == 2  # and it can run again
    finally:
        runtime.close()
