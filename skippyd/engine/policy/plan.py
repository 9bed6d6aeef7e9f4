"""What one iteration runs, and what the runtime reports back."""

from __future__ import annotations

import dataclasses
import enum
import logging
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

from skippyd.engine.policy.input_errors import PolicyInputError, checked_count

logger = logging.getLogger(__name__)


class IterationPhase(enum.Enum):
    """Why a work runs (the policy's phases; the runtime only knows prefill/decode)."""

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
    draft: tuple[int, ...] = ()
    """Tokens guessed to follow a decode row (speculative decoding), verified as extra
    rows after it; the driver attaches them (:meth:`IterationPlan.with_drafts`)."""

    @property
    def token_count(self) -> int:
        """Number of rows this work occupies in the batch, drafts included."""
        return len(self.tokens) + len(self.draft)

    @property
    def start_position(self) -> int:
        """Position of the first row."""
        return self.positions[0] if self.positions else 0

    def anon_repr(self) -> str:
        """A log-safe description without token ids."""
        return (
            f"IterationWork(id={self.sequence_id!r}, phase={self.phase.value}, "
            f"start={self.start_position}, tokens={self.token_count}, "
            f"draft={len(self.draft)}, sample_last={self.sample_last})"
        )


@dataclass(frozen=True, slots=True)
class IterationPrediction:
    """A sampled token for one work of a plan (sparse: only works that sample get one).

    A negative ``token`` is the runtime's stop signal (end of generation): the sequence
    finishes without appending it.
    """

    work_index: int
    """Index into ``plan.work``."""
    token: int
    more: tuple[int, ...] = ()
    """Tokens that follow ``token`` from the work's accepted drafts, in order (a negative
    one ends the sequence there); the last is the new pending token."""

    def __post_init__(self) -> None:
        index = checked_count(self.work_index, "IterationPrediction.work_index")
        object.__setattr__(self, "work_index", index)
        object.__setattr__(self, "token", _token(self.token))
        object.__setattr__(self, "more", tuple(_token(token) for token in self.more))


def _token(value: object) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # type: ignore[arg-type]  # numpy ints too
    except TypeError:
        raise PolicyInputError(
            f"IterationPrediction tokens must be integers, got {type(value).__name__}"
        ) from None


@dataclass(slots=True)
class IterationPlan:
    """The work of one native iteration, built fresh by every ``plan_iteration`` call.

    Nothing in a plan aliases scheduler state: the caller may keep or edit it freely.
    """

    work: list[IterationWork] = field(default_factory=list)
    """One work per scheduled sequence, in the order they were planned."""
    token_count: int = 0
    """Rows the plan puts in the batch: the sum of every work's ``token_count``."""
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

        Used by a driver that drops works whose generation went away before execution;
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

    def with_drafts(self, drafts: dict[int, tuple[int, ...]]) -> IterationPlan:
        """A copy whose decode works at the given indices carry those drafts.

        Raises:
            PolicyInputError: An index is not a decode work that samples.
        """
        work = list(self.work)
        for index, draft in drafts.items():
            target = work[index] if 0 <= index < len(work) else None
            if target is None or target.phase is not IterationPhase.DECODE or not target.sample_last:
                raise PolicyInputError(f"drafts go on sampling decode works, not work {index}")
            work[index] = dataclasses.replace(target, draft=tuple(draft))
        return IterationPlan(work=work, token_count=sum(w.token_count for w in work),
                             admitted_ids=self.admitted_ids, preempted=self.preempted)

    def without_drafts(self) -> IterationPlan:
        """A copy with every draft removed (drafts are optional work)."""
        work = [dataclasses.replace(w, draft=()) if w.draft else w for w in self.work]
        return IterationPlan(work=work, token_count=sum(w.token_count for w in work),
                             admitted_ids=self.admitted_ids, preempted=self.preempted)

    @property
    def num_drafted(self) -> int:
        """Draft rows of every work."""
        return sum(len(w.draft) for w in self.work)

    def phase_counts(self) -> tuple[int, int]:
        """``(prompt_rows, decode_works)`` of this plan: the rows of prefill and recompute
        works, and how many decode works (each one pending token, drafts not counted)."""
        prompt = sum(w.token_count for w in self.work if w.phase is not IterationPhase.DECODE)
        decode = sum(1 for w in self.work if w.phase is IterationPhase.DECODE)
        return prompt, decode
