"""What one decode step costs per row, unsplit and per stage, and the chain's ceiling.

A 2-stage chain can only beat one process if each stage's slice, on its own share of
the threads, decodes its rows as fast as the whole model does them on all the threads.
This measures the time of one ``llama_decode`` step for 1, 2, 3, 4 and 8 rows (each row
a session at least 60 tokens into its context) for the unsplit model on ``--threads`` threads
and for each stage's slice on half of them, then prints the decode-only ceiling of a
chain that cuts 8 rows into G groups: per 8-token step the slowest stage must decode
every group, so the chain reaches at most ``unsplit(8 rows) / max(stage total)``.

    python bench/split_row_cost.py [--split-at 17] [--threads 2] [--steps 30]
"""

from __future__ import annotations

import argparse

import numpy as np

from skippyd.bench.models import add_model_option, layer_bounds, model_path
from skippyd.engine.runtime.pipeline_types import split_token_groups
from skippyd.model_files.model_info import inspect_model
from skippyd.model_files.slice import cached_slice
from skippyd.split_measure import step_ms

ROWS = (1, 2, 3, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_option(parser)
    parser.add_argument("--split-at", type=int, default=None,
                        help="first layer of stage 1 (default: 17 of 30, scaled to the model)")
    parser.add_argument("--threads", type=int, default=2, help="the unsplit model's threads")
    parser.add_argument("--steps", type=int, default=30, help="decode steps per row count")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)),
                        help="row counts to time (the ceiling needs 1, 2, 3, 4 and 8)")
    args = parser.parse_args()
    row_counts = tuple(sorted({int(r) for r in args.rows.split(",")} | set(ROWS)))
    source = model_path(args)
    info = inspect_model(source)
    if args.split_at is None:
        args.split_at = layer_bounds(info.n_layer, 2)[1]
    if not 0 < args.split_at < info.n_layer:
        parser.error(f"--split-at: must be within 1..{info.n_layer - 1}")
    stage_threads = max(1, args.threads // 2)
    targets = [
        (f"unsplit, {args.threads} threads", str(source), args.threads, True, True),
        (f"stage 0 (layers 0-{args.split_at}), {stage_threads} thread(s)",
         str(cached_slice(source, 0, args.split_at)), stage_threads, True, False),
        (f"stage 1 (layers {args.split_at}-{info.n_layer} + output), {stage_threads} "
         "thread(s)", str(cached_slice(source, args.split_at, info.n_layer)),
         stage_threads, False, True),
    ]
    costs = []
    print("ms per decode step, by rows in the step")
    for name, path, threads, first, final in targets:
        cost = step_ms(path, threads=threads, first=first, final=final, n_embd=info.n_embd,
                       steps=args.steps, row_counts=row_counts)
        costs.append(cost)
        print(f"  {name:<48}" + "".join(f"{rows:>3}: {cost[rows]:6.1f}" for rows in row_counts),
              flush=True)
    unsplit, stage0, stage1 = costs
    print("decode-only ceiling of the chain at 8 rows (one process: "
          f"{unsplit[8]:.1f} ms per step)")
    for groups in (2, 3, 4):
        rows = [len(group) for group in split_token_groups([1] * 8, groups)]
        totals = [sum(float(np.interp(r, ROWS, [stage[x] for x in ROWS])) for r in rows)
                  for stage in (stage0, stage1)]
        print(f"  {groups} groups {rows}: stage 0 {totals[0]:.1f} ms, stage 1 "
              f"{totals[1]:.1f} ms per step -> at most {unsplit[8] / max(totals):.2f}x")


if __name__ == "__main__":
    main()
