"""What one decode step of 1, 2, … rows costs a first stage, timed on its own runtime.

Stage 0 of a split pipeline cuts each call's decode rows into batches by these costs
(``pipeline_types.decode_group_sizes``): on a CPU a step's cost is not proportional to
its rows, and the shape of that curve depends on the model's quantisation and the
machine's kernels, so it is timed once, when the stage starts and its runtime is idle,
rather than assumed.
"""

from __future__ import annotations

import time

from skippyd.engine.runtime.contract import IterationRequest, RowPhase, Runtime

#: Most rows timed: beyond this a row is taken to cost what the largest step's rows do.
PROBE_ROWS = 8
#: Tokens each scratch session holds before its decode steps (a little context, so a
#: step attends to something as real steps do).
PROBE_CONTEXT = 8
#: Names of the scratch sessions (the runtime holds no other session yet).
_SESSION = "step-probe-{}"


def time_decode_steps(runtime: Runtime, most_rows: int = PROBE_ROWS) -> list[float]:
    """Milliseconds of one decode step of ``k`` rows, for ``k`` in 1..``most_rows``.

    ``runtime`` is a first stage (it takes token ids) with no session live; it gets
    scratch sessions, one prompt call, one untimed step of every row and one timed step
    per row count, and the sessions are dropped again (one timing each: every second
    spent here delays the stage's readiness).
    """
    rows = max(1, min(most_rows, runtime.lane_count))
    sessions = [_SESSION.format(i) for i in range(rows)]
    try:
        for session in sessions:
            runtime.ensure_session_active(session)
        runtime.run_iteration([
            IterationRequest(session, [1 + (7 * i + p) % 97 for p in range(PROBE_CONTEXT)],
                             positions=range(PROBE_CONTEXT))
            for i, session in enumerate(sessions)])
        positions = [PROBE_CONTEXT] * rows
        timings = []
        for count in (rows, *range(1, rows + 1)):  # the first step warms up, untimed
            batch = [IterationRequest(session, [2 + i], positions=[positions[i]],
                                      phase=RowPhase.DECODE)
                     for i, session in enumerate(sessions[:count])]
            started = time.perf_counter()
            runtime.run_iteration(batch)
            timings.append((time.perf_counter() - started) * 1000)
            for i in range(count):
                positions[i] += 1
        return timings[1:]
    finally:
        for session in sessions:
            runtime.drop_session(session)
