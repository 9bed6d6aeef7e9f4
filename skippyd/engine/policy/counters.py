"""Counters and per-iteration reports of the scheduler."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerMetrics:
    """Cumulative counters plus the two current gauges.

    ``Scheduler.metrics()`` returns a copy; editing it changes nothing in the scheduler.
    """

    iterations: int = 0
    admitted: int = 0
    preempted: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected_overload: int = 0
    """Submits refused because the waiting queue was full."""
    prefill_tokens: int = 0
    recompute_tokens: int = 0
    decode_tokens: int = 0
    prefix_hits: int = 0
    """Submitted sequences that carried a prefix restore."""
    prefix_misses: int = 0
    active_sequences: int = 0
    """Gauge: sequences admitted now."""
    waiting_sequences: int = 0
    """Gauge: sequences waiting now."""


@dataclass(frozen=True, slots=True)
class IterationTelemetry:
    """What one ``complete_iteration`` call did."""

    iteration: int
    """``metrics.iterations`` after this iteration was counted."""
    active_sequences: int
    waiting_sequences: int
    admitted: int
    """Sequences admitted by the plan."""
    preempted: int
    """Copied from the plan (always 0 from ``plan_iteration``)."""
    prefill_tokens: int
    recompute_tokens: int
    decode_tokens: int
    component_used: tuple[tuple[str, int], ...]
    component_available: tuple[tuple[str, int], ...]
    prefix_hits: int
    prefix_misses: int
    finished: int
    failed: int
    cancelled: int
    rejected_overload: int
    finished_ids: tuple[str, ...] = ()
    """Sequences that finished in this iteration (skippyd addition, for the driver)."""
    failed_ids: tuple[str, ...] = ()
    """Sequences that failed in this iteration (skippyd addition, for the driver)."""


@dataclass(frozen=True, slots=True)
class SequenceProgress:
    """How far one active sequence has come."""

    sequence_id: str
    prompt_tokens: int
    generated_tokens: int
    replaying: bool
    """Prompt (or, after a preemption, recompute) tokens are still to go into the KV."""


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    """Who is where right now."""

    active_ids: tuple[str, ...]
    """Admitted sequence ids, sorted."""
    waiting_ids: tuple[str, ...]
    """Waiting sequence ids in queue order."""
    component_used: tuple[tuple[str, int], ...]
    """``(name, used)`` per memory component."""
