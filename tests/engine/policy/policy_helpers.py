"""Factories shared by the policy tests: a scheduler, sequences, and a fake runtime step."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from skippyd.bench.lab_scenarios import lab_config
from skippyd.engine.policy import (
    IterationPlan,
    IterationPrediction,
    IterationTelemetry,
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
)

_counter = itertools.count(1000)


def make_config(**overrides: object) -> SchedulerConfig:
    """The policy's own rules without a stage's step-time sizing (the lab's starting
    knobs: many sequences, 256-token chunks, prefill and decode apart), with
    ``overrides``."""
    return lab_config(**overrides)


def make_scheduler(**overrides: object) -> Scheduler:
    """A scheduler over :func:`make_config` with a deterministic clock."""
    ticks = itertools.count()
    return Scheduler(make_config(**overrides), clock=lambda: float(next(ticks)))


def make_sequence(sequence_id: str, prompt: Iterable[int] | int, max_tokens: int = 8,
                  **fields: object) -> ScheduledSequence:
    """A sequence; an int ``prompt`` means that many distinct tokens."""
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    return ScheduledSequence(sequence_id, tokens, max_tokens, **fields)


def sampling_predictions(
    plan: IterationPlan, token: int | None = None
) -> list[IterationPrediction]:
    """One prediction per sampling row; a fresh token each unless ``token`` is given."""
    return [
        IterationPrediction(index, next(_counter) if token is None else token)
        for index, work in enumerate(plan.work)
        if work.sample_last
    ]


def run_step(
    scheduler: Scheduler, token: int | None = None
) -> tuple[IterationPlan, IterationTelemetry]:
    """Plan, 'execute' by predicting every sampling row, and complete one iteration."""
    plan = scheduler.plan_iteration()
    return plan, scheduler.complete_iteration(plan, sampling_predictions(plan, token))


def work_ids(plan: IterationPlan) -> list[str]:
    """ScheduledSequence ids of a plan's works, in plan order."""
    return [work.sequence_id for work in plan.work]
