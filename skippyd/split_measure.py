"""What a stage's layers cost on this machine, timed: ``skippyd config split --measure``.

Bytes of weights predict a layer's work well for layers of one kind, less well for the
output head (its matrix is multiplied once per sampled row, and sampling follows it) or
for a machine whose speed depends on more than memory traffic. Here three stage slices of
the model are timed doing decode steps of several rows each: the first layer alone, the
first few layers, and the last layer with the head. The first two give the time per
byte of a layer's weights; the third, less the last layer's share, gives the head's time.
A fixed cost per step that every stage pays alike cancels out of the comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from skippyd.engine.runtime.contract import IterationRequest, RowPhase, SamplingConfig
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.engine.runtime.step_probe import time_steps, token_rows
from skippyd.model_files.model_info import inspect_model
from skippyd.model_files.slice import cached_slice
from skippyd.split_plan import ModelCosts, SplitError, Work

#: Tokens each timed session holds before its decode steps.
CONTEXT_TOKENS = 60
#: Rows in each timed decode step: a busy pipeline's step, not a lone stream's.
MEASURE_ROWS = 8
_GREEDY = SamplingConfig(temperature=0.0)


def step_ms(path: str | Path, *, threads: int, first: bool, final: bool, n_embd: int,
            steps: int, row_counts: Sequence[int]) -> dict[int, float]:
    """Median milliseconds of one decode step of ``rows`` sessions, for each row count.

    ``path`` is a whole model or a stage slice; ``first`` feeds it tokens, otherwise
    activation rows of width ``n_embd``; ``final`` samples each row.
    """
    runtime = LlamaRuntime(RuntimeOptions(str(path), lane_count=max(row_counts),
                                          ctx_size=4096, threads=threads,
                                          threads_batch=threads, first_stage=first,
                                          final_stage=final))
    rng = np.random.default_rng(0)

    def rows(session: str, index: int, count: int, position: int,
             phase: RowPhase) -> IterationRequest:
        if first:
            request = token_rows(session, index, count, position, phase)
            return replace(request, sampling=_GREEDY, sample_last=final)
        values = (rng.standard_normal((count, n_embd)) * 0.1).astype(np.float32)
        return IterationRequest(session, input_rows=values,
                                positions=range(position, position + count),
                                sampling=_GREEDY, sample_last=final, phase=phase)

    try:
        return time_steps(runtime, row_counts, steps=steps, context=CONTEXT_TOKENS, rows=rows)
    finally:
        runtime.close()


@dataclass(frozen=True, slots=True)
class Timing:
    """One timed slice: its layers and what a step of it took."""

    layer_start: int
    layer_end: int
    head: bool
    ms: float


def measure_work(model: str | Path, costs: ModelCosts, *, threads: int,
                 rows: int = MEASURE_ROWS, steps: int = 12,
                 report: Callable[[Timing], None] | None = None) -> Work:
    """Time ``model``'s layers and head on this machine (ms per decode step of ``rows``
    rows on ``threads`` threads), as :class:`Work` for :func:`plan_split`.

    Raises:
        SplitError: The model has fewer than 3 layers (nothing to fit a slope to), or the
            timings contradict each other (another load on the machine).
    """
    n = len(costs.layers)
    if n < 3:
        raise SplitError(f"--measure: needs a model of 3 layers or more (this one has {n})")
    few = max(2, min(n - 1, n // 4))
    info = inspect_model(model)
    timings = []
    for start, end, final in ((0, 1, False), (0, few, False), (n - 1, n, True)):
        path = cached_slice(model, start, end)
        ms = step_ms(path, threads=threads, first=start == 0, final=final,
                     n_embd=info.n_embd, steps=steps, row_counts=(rows,))[rows]
        timing = Timing(start, end, final, ms)
        timings.append(timing)
        if report is not None:
            report(timing)
    one, several, last = timings
    extra_bytes = sum(costs.layers[1:few])
    if several.ms <= one.ms or not extra_bytes:
        raise SplitError(f"--measure: {few} layers timed no slower than 1 ({several.ms:.1f} "
                         f"against {one.ms:.1f} ms): the machine is too busy to measure")
    per_byte = (several.ms - one.ms) / extra_bytes
    fixed = one.ms - per_byte * costs.layers[0]
    head = max(0.0, last.ms - fixed - per_byte * costs.layers[-1])
    return Work(tuple(per_byte * size for size in costs.layers), head, "ms")
