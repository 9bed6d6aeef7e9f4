"""What one decode step of 1, 2, … rows costs a runtime, timed on that runtime.

Stage 0 of a split pipeline cuts each call's decode rows into batches by these costs
(``pipeline_types.decode_group_sizes``): on a CPU a step's cost is not proportional to
its rows, and the shape of that curve depends on the model's quantisation and the
machine's kernels, so it is timed once, when the stage starts and its runtime is idle,
rather than assumed. ``skippyd config split --measure`` times stage slices the same way
(``split_measure``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from skippyd.engine.runtime.contract import IterationRequest, RowPhase, Runtime

#: Most rows timed: beyond this a row is taken to cost what the largest step's rows do.
PROBE_ROWS = 8
#: Tokens each scratch session holds before its decode steps (a little context, so a
#: step attends to something as real steps do).
PROBE_CONTEXT = 8
#: Names of the scratch sessions (the runtime holds no other session yet).
_SESSION = "step-probe-{}"

#: Builds one session's rows: (session, session index, rows, first position, phase).
RowMaker = Callable[[str, int, int, int, RowPhase], IterationRequest]


def token_rows(session: str, index: int, count: int, position: int,
               phase: RowPhase) -> IterationRequest:
    """Token input for a first stage: arbitrary ids, explicit positions, nothing sampled."""
    return IterationRequest(session, [1 + (7 * index + p) % 97
                                      for p in range(position, position + count)],
                            positions=range(position, position + count), phase=phase)


def time_steps(runtime: Runtime, row_counts: Sequence[int], *, steps: int = 1,
               context: int = PROBE_CONTEXT,
               rows: RowMaker = token_rows) -> dict[int, float]:
    """Median milliseconds of one decode step of ``k`` rows, for each ``k`` in
    ``row_counts``, over ``steps`` timed steps each.

    ``runtime`` must have no session live. It gets one scratch session per row of the
    largest count, one call that gives each ``context`` tokens, one untimed step of every
    row, then the timed steps (each count on the first ``k`` sessions, their positions
    going on); the sessions are dropped again.
    """
    counts = sorted({k for k in row_counts if k > 0})
    sessions = [_SESSION.format(i) for i in range(max(counts, default=0))]
    try:
        for session in sessions:
            runtime.ensure_session_active(session)
        if not sessions:
            return {}
        runtime.run_iteration([rows(session, i, context, 0, RowPhase.PREFILL)
                               for i, session in enumerate(sessions)])
        positions = [context] * len(sessions)

        def step(count: int) -> float:
            batch = [rows(session, i, 1, positions[i], RowPhase.DECODE)
                     for i, session in enumerate(sessions[:count])]
            started = time.perf_counter()
            runtime.run_iteration(batch)
            for i in range(count):
                positions[i] += 1
            return (time.perf_counter() - started) * 1000

        step(len(sessions))  # warms the runtime up, untimed
        return {k: statistics.median(step(k) for _ in range(max(1, steps))) for k in counts}
    finally:
        for session in sessions:
            runtime.drop_session(session)


def time_decode_steps(runtime: Runtime, most_rows: int = PROBE_ROWS) -> list[float]:
    """Milliseconds of one decode step of ``k`` rows, for ``k`` in 1..``most_rows`` (at
    most the runtime's lanes), a first stage with no session live: one timing each, as
    every second spent here delays the stage's readiness."""
    rows = max(1, min(most_rows, runtime.lane_count))
    costs = time_steps(runtime, range(1, rows + 1))
    return [costs[k] for k in range(1, rows + 1)]
