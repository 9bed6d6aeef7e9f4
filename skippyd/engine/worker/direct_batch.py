"""Direct iterations: what they are, how they are checked and how they are batched.

A direct iteration is caller-shaped work (explicit tokens or activation rows, explicit
positions) that bypasses the planning policy: a later stage of a split pipeline runs
what its upstream stage sends this way. The batch worker
(:mod:`~skippyd.engine.worker.batches`) takes queued direct iterations into one runtime
call per turn with :func:`take_direct_iteration_batch`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from skippyd.engine.runtime.contract import (
    IterationRequest,
    RowPhase,
    SamplingConfig,
    SessionAlignment,
)
from skippyd.engine.worker.worker_errors import (
    DeadlineExceededError,
    InvalidRequestError,
    RequestCancelledError,
)

logger = logging.getLogger(__name__)

#: Hard cap on the tokens of one native iteration.
MAX_NATIVE_ITERATION_TOKENS = 2048
#: How long the worker waits for peers of a lone direct iteration.
DIRECT_ITERATION_COALESCE_WINDOW_S = 0.002


def direct_coalesce_target(active_runtime_sessions: int, queued_direct: int, max_batch: int,
                           head_group: DirectGroup | None = None) -> int:
    """How many direct iterations are worth waiting for.

    As many as there are active sessions (their next steps are coming), never more than
    one batch, and never fewer than are already queued, so a lone session is not delayed.
    A group at the head of the queue is waited for until it is complete, no longer:
    the next group is another micro-batch of the pipeline, not a peer of this one.
    """
    if head_group is not None:
        return head_group.size
    return min(max(active_runtime_sessions, queued_direct), max_batch)


def pipeline_group_batch_size(max_batch: int, groups: int) -> int:
    """Lanes per decode group, rounded up and at least 1."""
    return max(math.ceil(max_batch / max(groups, 1)), 1)


def validate_direct_iteration(
    token_ids: Sequence[int],
    positions: Sequence[int],
    max_iteration_tokens: int | None,
    input_rows: np.ndarray | None = None,
    draft: Sequence[int] = (),
) -> None:
    """Check a direct iteration's shape before it is queued.

    Args:
        token_ids: Input tokens (or the token sideband of activation rows).
        positions: Empty, or a whole number of positions per token (mRoPE uses 4).
        max_iteration_tokens: Configured limit; None means only the native cap.
        input_rows: Optional activation rows, one per token (and per draft).
        draft: Drafted tokens verified after the input.

    Raises:
        InvalidRequestError: The shape cannot run as one native iteration.
    """
    rows = len(token_ids) + len(draft) if input_rows is None else int(input_rows.shape[0])
    num_tokens = rows - len(draft)
    if input_rows is not None and token_ids and len(token_ids) != num_tokens:
        raise InvalidRequestError(
            f"input rows ({num_tokens}) and token ids ({len(token_ids)}) disagree"
        )
    if num_tokens <= 0:
        raise InvalidRequestError("scheduler iteration requires at least one token")
    limit = MAX_NATIVE_ITERATION_TOKENS
    if max_iteration_tokens is not None:
        limit = min(max_iteration_tokens, MAX_NATIVE_ITERATION_TOKENS)
    if rows > limit:
        raise InvalidRequestError(
            f"scheduler iteration has {rows} tokens, which exceeds the "
            f"{limit}-token configured iteration limit"
        )
    if positions and len(positions) % num_tokens != 0:
        raise InvalidRequestError("scheduler iteration positions must be empty or token-major")


@dataclass(frozen=True, slots=True)
class IterationOutcome:
    """One caller's share of a direct batched iteration."""

    predicted: int
    """Sampled token, or -1 when the request did not sample."""
    is_eog: bool
    output_rows: np.ndarray | None
    """Captured activation rows (non-final stage) or None."""
    batch_size: int
    batch_wait_ms: float
    """Time this request spent queued before its batch ran."""
    run_ms: float
    """Time the batched runtime call took."""
    session_alignment: SessionAlignment | None = None
    followers: tuple[tuple[int, bool], ...] = ()
    """(token, ends generation) sampled after ``predicted`` at the rows of the drafts it
    confirmed (see :attr:`IterationSample.followers`)."""
    drafted: int = 0
    """Drafts verified, accepted or not."""


@dataclass(frozen=True, slots=True)
class DirectGroup:
    """Direct iterations that arrived together and must run together, and alone.

    A later stage of a split pipeline receives stage 0's decode groups as batches of
    the stage link; each batch's entries carry one group. Running a group in one call
    without waiting for more keeps the pipeline's micro-batches intact: merging two
    would hold the first one's result back until the second is computed.
    """

    key: object
    """Identifies the group (the link connection and batch id)."""
    size: int
    """How many direct iterations belong to it."""


@dataclass(slots=True)
class DirectIteration:
    """A queued direct iteration."""

    session_id: str
    token_ids: Sequence[int] = ()
    positions: Sequence[int] = ()
    sampling: SamplingConfig | None = None
    input_rows: np.ndarray | None = None
    sample_last: bool = False
    phase: RowPhase = RowPhase.PREFILL
    draft: Sequence[int] = ()
    """Drafted tokens to verify after the input (final stage; ``input_rows`` holds
    their rows too)."""
    target_token_count: int | None = None
    """Trim the session to this many tokens first if it is ahead."""
    group: DirectGroup | None = None
    """Run with exactly the other iterations of this group (see :class:`DirectGroup`)."""
    deadline: float | None = None
    """``time.monotonic()`` after which it must not run, and its caller stops waiting."""
    cancelled: threading.Event | None = None
    """Set by the caller when nobody wants the result any more (the link closed)."""
    lane: int | None = None
    """The lane a new session would rather have (see :attr:`IterationRequest.lane`)."""
    enqueued_at: float = field(default_factory=time.monotonic)
    reply: Future[IterationOutcome] = field(default_factory=Future)

    def ensure_active(self) -> None:
        """Raise if it was cancelled or its deadline passed (cancellation first).

        Raises:
            RequestCancelledError: Its cancellation event is set.
            DeadlineExceededError: Its deadline passed.
        """
        if self.cancelled is not None and self.cancelled.is_set():
            raise RequestCancelledError("request cancelled during scheduler iteration")
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise DeadlineExceededError("deadline exceeded during scheduler iteration")

    def outcome(self) -> IterationOutcome:
        """Wait for the worker's reply, no longer than the deadline.

        A deadline that passed wins even over a reply that came in the meantime.

        Raises:
            WorkerError: The worker's error, or a deadline or cancellation one.
        """
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            result = self.reply.result(timeout)
        except TimeoutError:
            raise DeadlineExceededError("deadline exceeded during scheduler iteration") from None
        self.ensure_active()
        return result

    @property
    def num_rows(self) -> int:
        """Rows it puts in a batch: its input and its drafts."""
        if self.input_rows is not None:
            return int(self.input_rows.shape[0])
        return len(self.token_ids) + len(self.draft)

    def make_runtime_request(self) -> IterationRequest:
        return IterationRequest(
            session_id=self.session_id,
            token_ids=self.token_ids,
            input_rows=self.input_rows,
            positions=self.positions or None,
            sampling=self.sampling,
            sample_last=self.sample_last,
            phase=self.phase,
            draft=self.draft,
            lane=self.lane,
        )


class _Batchable(Protocol):
    @property
    def session_id(self) -> str: ...

    @property
    def num_rows(self) -> int: ...

    @property
    def group(self) -> DirectGroup | None: ...


B = TypeVar("B", bound=_Batchable)


def take_direct_iteration_batch(queue: deque[B], max_batch_size: int, token_budget: int) -> list[B]:
    """Take one runtime batch off ``queue`` in place.

    One front-to-back scan. When the head belongs to a :class:`DirectGroup`, only
    that group's requests are taken (all of them, up to the budget); otherwise only
    ungrouped ones. A session already claimed (batched, or deferred earlier in
    this scan) is deferred to keep per-session order; a request larger than the budget
    left claims its session and is deferred while the scan continues, so small decode
    rows behind a big prefill chunk still join the wave. The queue becomes the deferred
    requests (original order) followed by the unscanned rest, so a deferred chunk stays
    ahead of later arrivals and, as a fresh budget fits the head, cannot starve.
    """
    batch: list[B] = []
    deferred: list[B] = []
    claimed: set[str] = set()
    budget = token_budget
    group = queue[0].group if queue else None
    if group is not None:
        # A group runs whole and alone, however wide (it never exceeds the lanes).
        max_batch_size = max(max_batch_size, group.size)
    while queue and len(batch) < max_batch_size and budget > 0:
        request = queue.popleft()
        if request.session_id in claimed or request.group != group:
            deferred.append(request)
            continue
        claimed.add(request.session_id)
        if request.num_rows > budget and (batch or deferred):
            deferred.append(request)
            continue
        # NOTE: an over-budget head with nothing before it still runs alone; validation
        # keeps this unreachable, but it must never be deferred forever.
        batch.append(request)
        budget -= request.num_rows
    queue.extendleft(reversed(deferred))
    return batch


def resolve_future(future: Future[Any], value: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` once, ignoring a caller that already cancelled it."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except InvalidStateError:
        pass
