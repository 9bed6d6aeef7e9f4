"""The policy's view of one generation request."""

from __future__ import annotations

import copy
import enum
import logging
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

from skippyd.engine.policy.cache_order import CacheAffinity
from skippyd.engine.policy.input_errors import PolicyInputError, checked_count

logger = logging.getLogger(__name__)


class SequenceStatus(enum.Enum):
    """Lifecycle of a sequence inside the scheduler."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    FAILED = "failed"

    def is_finished(self) -> bool:
        """True for the two terminal statuses, Finished and Failed."""
        return self in (SequenceStatus.FINISHED, SequenceStatus.FAILED)


class PrefixRestoreKind(enum.Enum):
    """What kind of saved state a restored prefix comes from."""

    RESIDENT_KV = "resident_kv"
    RECURRENT_WHOLE_STATE = "recurrent_whole_state"
    KV_AND_RECURRENT_WHOLE_STATE = "kv_and_recurrent_whole_state"


@dataclass(frozen=True, slots=True)
class PrefixRestore:
    """A leading span of the prompt that will be restored instead of computed."""

    page_id: str
    """Identifier of the cached page the span comes from."""
    token_count: int
    """Number of leading prompt tokens the restore covers."""
    kind: PrefixRestoreKind = PrefixRestoreKind.RESIDENT_KV
    """Kind of saved state."""

    def __post_init__(self) -> None:
        checked_count(self.token_count, "PrefixRestore.token_count")
        if not isinstance(self.kind, PrefixRestoreKind):
            raise PolicyInputError(f"PrefixRestore.kind must be a PrefixRestoreKind: {self.kind!r}")


def _token_tuple(tokens: Iterable[int], what: str) -> tuple[int, ...]:
    try:
        return tuple(map(operator.index, tokens))
    except TypeError:
        raise PolicyInputError(f"{what} must be a sequence of integer token ids") from None


@dataclass(eq=False, repr=False)
class ScheduledSequence:
    """The policy's view of one generation: prompt, generated tokens and scheduling state.

    ``admission_tokens`` defaults to ``len(prompt) + max_tokens``. The builder methods
    (``with_*``) mutate and return ``self``; call them before submitting. Once submitted,
    the scheduler changes this very object (the caller keeps a reference to read its
    progress, never to change it); ``Scheduler.sequence`` hands out copies.

    ``prefill_cursor``, ``enqueued_turn``, ``enqueue_order`` and ``admission_serial`` are
    managed by the scheduler and are readable for tests and telemetry.
    """

    id: str
    """Unique among waiting and active sequences; the worker uses the generation's
    ``request_id``."""
    prompt_tokens: tuple[int, ...]
    """Prompt token ids; stored as an immutable tuple."""
    max_tokens: int
    """Generation ceiling: the sequence finishes once it holds this many tokens."""
    sampling: object | None = None
    """Sampling configuration; opaque to the policy and copied into every work."""
    admission_tokens: int | None = None
    """Tokens of memory reserved on admission; None means ``len(prompt) + max_tokens``."""
    generated_tokens: list[int] = field(default_factory=list)
    """Tokens produced so far; the last one is the pending decode token."""
    status: SequenceStatus = SequenceStatus.WAITING
    prefix_restore: PrefixRestore | None = None
    cache_affinity: CacheAffinity = field(default_factory=CacheAffinity)
    admitted_at: float | None = None
    """Scheduler clock reading at the last admission; None while not admitted."""
    prefill_cursor: int = 0
    """How many replay tokens are already in the KV (scheduler-managed)."""
    enqueued_turn: int = 0
    """Scheduler turn of the first submit; kept across preemption (aging credit)."""
    enqueue_order: int = 0
    """Monotone tie-break counter; renewed on preemption."""
    admission_serial: int = -1
    """Order of the last admission among all admissions (-1 while not admitted)."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str):
            raise PolicyInputError(f"ScheduledSequence.id must be a str, got {type(self.id).__name__}")
        self.prompt_tokens = _token_tuple(self.prompt_tokens, "ScheduledSequence.prompt_tokens")
        self.generated_tokens = list(
            _token_tuple(self.generated_tokens, "ScheduledSequence.generated_tokens")
        )
        self.max_tokens = checked_count(self.max_tokens, "ScheduledSequence.max_tokens")
        if self.admission_tokens is None:
            self.admission_tokens = len(self.prompt_tokens) + self.max_tokens
        self.admission_tokens = checked_count(self.admission_tokens, "ScheduledSequence.admission_tokens")
        if not isinstance(self.cache_affinity, CacheAffinity):
            raise PolicyInputError("ScheduledSequence.cache_affinity must be a CacheAffinity")

    # -- builders ------------------------------------------------------------------------

    def with_admission_tokens(self, tokens: int) -> ScheduledSequence:
        """Reserve ``max(tokens, len(prompt))`` tokens of memory on admission."""
        self.admission_tokens = max(checked_count(tokens, "admission tokens"),
                                    len(self.prompt_tokens))
        return self

    def with_prefix_restore(self, restore: PrefixRestore) -> ScheduledSequence:
        """Start the prefill after a restored prefix.

        At least one token is always replayed: a restored prefix carries no sampled next
        token, so logits must come from computing the last prompt token.
        """
        if not isinstance(restore, PrefixRestore):
            raise PolicyInputError("with_prefix_restore needs a PrefixRestore")
        self.prefill_cursor = min(restore.token_count, max(0, self.recompute_token_count() - 1))
        self.prefix_restore = restore
        return self

    def with_cache_affinity(self, affinity: CacheAffinity) -> ScheduledSequence:
        """Set the cache matches used by cache-aware admission ordering."""
        if not isinstance(affinity, CacheAffinity):
            raise PolicyInputError("with_cache_affinity needs a CacheAffinity")
        self.cache_affinity = affinity
        return self

    # -- derived views ---------------------------------------------------------------------

    def recompute_tokens(self) -> list[int]:
        """Prompt plus every generated token but the last (the pending decode token)."""
        return list(self.prompt_tokens) + self.generated_tokens[:-1]

    def recompute_token_count(self) -> int:
        """Length of :meth:`recompute_tokens` without building it."""
        return len(self.prompt_tokens) + max(0, len(self.generated_tokens) - 1)

    def replay_remaining(self) -> int:
        """Replay tokens the prefill cursor has not reached yet."""
        return self.recompute_token_count() - self.prefill_cursor

    def replay_slice(self, start: int, stop: int) -> tuple[int, ...]:
        """``recompute_tokens()[start:stop]`` without concatenating the whole prompt."""
        prompt_len = len(self.prompt_tokens)
        head = self.prompt_tokens[start:stop] if start < prompt_len else ()
        if stop <= prompt_len:
            return head
        tail = self.generated_tokens[max(0, start - prompt_len): stop - prompt_len]
        return head + tuple(tail)

    def pending_decode_token(self) -> int | None:
        """The last generated token (not yet in the KV), or None."""
        return self.generated_tokens[-1] if self.generated_tokens else None

    def needs_replay(self) -> bool:
        """True while some prompt/recompute tokens are not yet in the KV."""
        return self.prefill_cursor < self.recompute_token_count()

    def is_live_decoder(self) -> bool:
        """True when caught up and holding a pending decode token."""
        return not self.needs_replay() and bool(self.generated_tokens)

    def reset_for_recompute(self) -> None:
        """Return to the waiting state after preemption.

        The cursor restarts at the restored prefix, if any.

        NOTE: with no generated token and a restore covering the whole prompt, clamping
        to the whole replay would leave nothing to sample from and the sequence would
        wait forever, so, as in ``with_prefix_restore``, at least one token is replayed
        while nothing has been generated yet.
        """
        self.status = SequenceStatus.PREEMPTED
        self.admitted_at = None
        self.admission_serial = -1
        restored = self.prefix_restore.token_count if self.prefix_restore else 0
        replay_len = self.recompute_token_count()
        limit = replay_len if self.generated_tokens else max(0, replay_len - 1)
        self.prefill_cursor = min(restored, limit)

    def clone(self) -> ScheduledSequence:
        """A copy that shares nothing mutable with this sequence."""
        duplicate = copy.copy(self)
        duplicate.generated_tokens = list(self.generated_tokens)
        return duplicate

    def __repr__(self) -> str:
        return self.anon_repr()

    def anon_repr(self) -> str:
        """A log-safe description without prompt or generated token ids."""
        return (
            f"ScheduledSequence(id={self.id!r}, prompt={len(self.prompt_tokens)} tokens, "
            f"generated={len(self.generated_tokens)}, max_tokens={self.max_tokens}, "
            f"status={self.status.value}, "
            f"cursor={self.prefill_cursor})"
        )
