"""What one iteration runs, and what the runtime reports back."""

from __future__ import annotations

import enum
import logging
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

from skippyd.engine.policy.input_errors import PolicyInputError, checked_count

logger = logging.getLogger(__name__)


class IterationPhase(enum.Enum):
    """Why a work row runs (the policy's phases; the runtime only knows prefill/decode)."""

    PREFILL = "prefill"
    """A prompt chunk; nothing generated yet."""
    RECOMPUTE = "recompute"
    """Replaying prompt + generated tokens after preemption; never samples."""
    DECODE = "decode"
    """One pending generated token at the next position."""


@dataclass(frozen=True, slots=True)
class IterationWork:
    """One sequence's rows in an iteration."""

    sequence_id: str
    tokens: tuple[int, ...]
    """Token ids to feed, in position order."""
    positions: tuple[int, ...]
    """Contiguous positions ``start .. start + len(tokens)``."""
    sample_last: bool
    """Whether the runtime must sample a token from the last row."""
    phase: IterationPhase
    sampling: object | None = None
    """The sequence's sampling configuration (opaque to the policy)."""

    @property
    def token_count(self) -> int:
        """Number of rows this work occupies in the batch."""
        return len(self.tokens)

    @property
    def start_position(self) -> int:
        """Position of the first row."""
        return self.positions[0] if self.positions else 0

    def anon_repr(self) -> str:
        """A log-safe description without token ids."""
        return (
            f"IterationWork(id={self.sequence_id!r}, phase={self.phase.value}, "
            f"start={self.start_position}, tokens={self.token_count}, "
            f"sample_last={self.sample_last})"
        )


@dataclass(frozen=True, slots=True)
class IterationPrediction:
    """A sampled token for one work row of a plan (sparse).

    A negative ``token`` is the runtime's stop signal (end of generation): the sequence
    finishes without appending it.
    """

    work_index: int
    """Index into ``plan.work``."""
    token: int

    def __post_init__(self) -> None:
        index = checked_count(self.work_index, "IterationPrediction.work_index")
        object.__setattr__(self, "work_index", index)
        try:
            if isinstance(self.token, bool):
                raise TypeError
            object.__setattr__(self, "token", operator.index(self.token))  # numpy ints too
        except TypeError:
            raise PolicyInputError(
                f"IterationPrediction.token must be an integer, got {type(self.token).__name__}"
            ) from None


@dataclass(slots=True)
class IterationPlan:
    """The work of one native iteration, built fresh by every ``plan_iteration`` call.

    Nothing in a plan aliases scheduler state: the caller may keep or edit it freely.
    """

    work: list[IterationWork] = field(default_factory=list)
    """Work rows, in the order they were planned."""
    token_count: int = 0
    """Sum of ``len(work.tokens)``."""
    admitted_ids: tuple[str, ...] = ()
    """Sequences admitted at the start of this plan (again, after a preemption)."""
    preempted: int = 0
    """Always 0 from ``plan_iteration``: preemption is a separate call."""

    @property
    def admitted(self) -> int:
        """How many sequences were admitted at the start of this plan."""
        return len(self.admitted_ids)

    def is_empty(self) -> bool:
        """True when there is nothing to run."""
        return not self.work

    def without_sequences(self, sequence_ids: Iterable[str]) -> IterationPlan:
        """A copy without the works of ``sequence_ids``, with ``token_count`` recomputed.

        Used by a driver that drops works whose request went away before execution;
        prediction ``work_index`` values then refer to the returned plan.
        """
        dropped = set(sequence_ids)
        kept = [work for work in self.work if work.sequence_id not in dropped]
        return IterationPlan(
            work=kept,
            token_count=sum(work.token_count for work in kept),
            admitted_ids=self.admitted_ids,
            preempted=self.preempted,
        )

    def phase_counts(self) -> tuple[int, int]:
        """``(prefill_or_recompute_tokens, decode_rows)`` of this plan."""
        prompt = sum(w.token_count for w in self.work if w.phase is not IterationPhase.DECODE)
        decode = sum(1 for w in self.work if w.phase is IterationPhase.DECODE)
        return prompt, decode
