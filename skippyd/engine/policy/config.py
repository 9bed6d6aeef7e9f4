"""Scheduler settings and memory components."""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from skippyd.engine.policy.input_errors import PolicyInputError, SchedulerConfigError, checked_count

logger = logging.getLogger(__name__)

#: llama.cpp's hard cap on sequence ids per context.
LLAMA_MAX_SEQ = 256
#: "No limit" for a count.
UNLIMITED = sys.maxsize


@dataclass(frozen=True, slots=True)
class MemoryComponent:
    """One independently constrained memory pool.

    Every amount is in the component's own unit: KV cells for ``kv-cells`` (one per
    token), bytes for ``recurrent-state``.
    """

    name: str
    capacity: int
    resident: int = 0
    """Already occupied by state the scheduler does not manage (weights, pinned pages)."""
    per_token: int = 0
    per_sequence: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SchedulerConfigError("memory_components.name", "must be a non-empty string")
        for name in ("capacity", "resident", "per_token", "per_sequence"):
            try:
                checked_count(getattr(self, name), name)
            except PolicyInputError as error:
                raise SchedulerConfigError(f"memory_components[{self.name}].{name}",
                                           str(error)) from None

    def available(self) -> int:
        """Capacity left for the scheduler: ``max(0, capacity - resident)``."""
        return max(0, self.capacity - self.resident)

    def reservation(self, admission_tokens: int) -> int:
        """What admitting a sequence of ``admission_tokens`` tokens reserves here."""
        return self.per_sequence + self.per_token * admission_tokens

    def request_cost(self, prompt_tokens: int, max_tokens: int) -> int:
        """What a request would cost at its full generation ceiling (helper only)."""
        return self.per_sequence + self.per_token * (prompt_tokens + max_tokens)


_COUNT_FIELDS = (
    "max_active_sequences",
    "max_waiting_sequences",
    "max_tokens_per_iteration",
    "prefill_chunk_tokens",
    "max_prefill_sequences_per_iteration",
    "max_consecutive_prefill_iterations",
    "cache_aging_cost_per_iteration",
    "target_step_us",
    "sample_tail_tokens",
)


#: ``sample_tail_tokens`` of stage 0 of a split pipeline: the least piece the pipeline
#: cuts a prompt into, so the sampled end costs the later stages about as little as a
#: piece can.
PIPELINE_SAMPLE_TAIL = 8
#: Most decode steps a step's target may be (``target_decode_steps``).
MAX_TARGET_DECODE_STEPS = 1000


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduler knobs; ``Scheduler`` always works on ``normalized()``.

    The defaults are what a stage serving an attention-only model runs with under the
    default ``[runtime]`` settings (4 lanes, ``queue_capacity`` 64, ``n_batch`` 2048,
    ``n_ubatch`` 512, ``target_step_ms`` 250), less its memory components. Counts must be
    non-negative integers (a negative value raises :class:`SchedulerConfigError`); zero
    and oversize values are clamped by :meth:`normalized`.
    """

    max_active_sequences: int = 4
    """Most sequences admitted at once (the stage's lanes); capped at ``LLAMA_MAX_SEQ``."""
    max_waiting_sequences: int = 64
    """Waiting-queue capacity; ``submit`` beyond it fails with ``WaitingQueueFullError``."""
    max_tokens_per_iteration: int = 2048
    """Token budget of one native iteration (prefill chunks plus decode rows)."""
    prefill_chunk_tokens: int = 512
    """Most prompt/recompute tokens of one sequence per iteration."""
    max_prefill_sequences_per_iteration: int = UNLIMITED
    """Most distinct sequences prefilling in one plan (1 for recurrent models)."""
    max_consecutive_prefill_iterations: int = 1
    """Prefill-only iterations allowed back to back while decoders wait."""
    mixed_prefill_decode: bool = True
    """Allow decode rows and prefill rows in one iteration (False for recurrent models)."""
    target_step_us: int = 250_000
    """With ``mixed_prefill_decode``: give iterations that carry decode rows only as many
    prompt tokens as fit in this step time (µs), from learned costs (``step_budget``);
    0 keeps the calibration-gated mixing."""
    target_decode_steps: float = 4.0
    """With ``target_step_us``: the step time is at least this many times the estimated
    step of the decode rows alone (``StepCostModel.step_target_us``); 0: the target
    alone."""
    sample_tail_tokens: int = 0
    """A prompt's sampled end goes in a chunk of its own of this many tokens, planned
    after the rest of the prompt, when the rest is at least as long (0: off). Stage 0 of
    a split pipeline sets it: a call returns only once its samples are back, so a long
    sampled chunk keeps stage 0 idle while the later stages compute it, where a chunk
    that samples nothing travels on while stage 0 goes on (``docs/scheduler.md``)."""
    cache_aging_cost_per_iteration: int = 4096
    """Credit a waiting request gains per turn (anti-starvation)."""
    group_waiting_prefixes: bool = True
    """Enable the waiting-prefix DFS tie-break."""
    memory_components: tuple[MemoryComponent, ...] = field(default_factory=tuple)
    """Independently constrained memory pools."""

    def __post_init__(self) -> None:
        for name in _COUNT_FIELDS:
            try:
                checked_count(getattr(self, name), name)
            except PolicyInputError as error:
                raise SchedulerConfigError(name, str(error)) from None
        for name in ("mixed_prefill_decode", "group_waiting_prefixes"):
            if not isinstance(getattr(self, name), bool):
                raise SchedulerConfigError(name, "must be a bool")
        steps = self.target_decode_steps
        if (isinstance(steps, bool) or not isinstance(steps, int | float)
                or not math.isfinite(steps) or not 0 <= steps <= MAX_TARGET_DECODE_STEPS):
            raise SchedulerConfigError(
                "target_decode_steps",
                f"must be a number from 0 to {MAX_TARGET_DECODE_STEPS}, got {steps!r}")
        object.__setattr__(self, "memory_components", _components(self.memory_components))

    def normalized(self) -> SchedulerConfig:
        """Clamp every count into its usable range and return the result."""
        max_tokens = max(1, self.max_tokens_per_iteration)
        return dataclasses.replace(
            self,
            max_active_sequences=min(max(self.max_active_sequences, 1), LLAMA_MAX_SEQ),
            max_waiting_sequences=max(1, self.max_waiting_sequences),
            max_tokens_per_iteration=max_tokens,
            prefill_chunk_tokens=min(max(self.prefill_chunk_tokens, 1), max_tokens),
            max_prefill_sequences_per_iteration=max(1, self.max_prefill_sequences_per_iteration),
            max_consecutive_prefill_iterations=max(1, self.max_consecutive_prefill_iterations),
            cache_aging_cost_per_iteration=max(1, self.cache_aging_cost_per_iteration),
        )


def _components(components: Iterable[MemoryComponent]) -> tuple[MemoryComponent, ...]:
    result = tuple(components)
    for component in result:
        if not isinstance(component, MemoryComponent):
            raise SchedulerConfigError(
                "memory_components", f"entries must be MemoryComponent, got {component!r}"
            )
    names = [component.name for component in result]
    if len(set(names)) != len(names):
        raise SchedulerConfigError("memory_components", f"names must be unique: {names}")
    return result
