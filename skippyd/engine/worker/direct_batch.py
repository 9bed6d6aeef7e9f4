"""Direct iterations: validation, batching and execution.

A direct iteration is caller-shaped work (explicit tokens or activation rows, explicit
positions) that bypasses the planning policy: a later stage of a split pipeline runs
what its upstream stage sends this way. The worker batches queued direct iterations into one runtime call per
turn with :func:`take_direct_iteration_batch` and runs it with
:func:`run_direct_iteration_batch`.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from skippyd.engine.runtime.protocol import (
    IterationOutput,
    IterationPhase,
    IterationRequest,
    Runtime,
    RuntimeFailure,
    SamplingConfig,
    SessionAlignment,
)
from skippyd.engine.worker.commands import (
    InvalidRequestError,
    IterationOutcome,
    WorkerBackendError,
    WorkerError,
    worker_error_from_runtime,
)
from skippyd.engine.worker.telemetry import SCHEDULER_DIRECT_ITERATION

logger = logging.getLogger(__name__)

#: Hard cap on the tokens of one native iteration.
MAX_NATIVE_ITERATION_TOKENS = 2048
#: How long the worker waits for peers of a lone direct iteration.
DIRECT_ITERATION_COALESCE_WINDOW_S = 0.002

Publish = Callable[[str, Mapping[str, Any]], None]


def should_serve_direct(has_direct: bool, has_planned: bool, last_served_direct: bool) -> bool:
    """Strictly alternate direct and planned work when both wait."""
    if has_direct and has_planned:
        return not last_served_direct
    return has_direct


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
) -> None:
    """Check a direct iteration's shape before it is queued.

    Args:
        token_ids: Input tokens (or the token sideband of activation rows).
        positions: Empty, or a whole number of positions per token (mRoPE uses 4).
        max_iteration_tokens: Configured limit; None means only the native cap.
        input_rows: Optional activation rows, one per token.

    Raises:
        InvalidRequestError: The shape cannot run as one native iteration.
    """
    num_tokens = len(token_ids) if input_rows is None else int(input_rows.shape[0])
    if input_rows is not None and token_ids and len(token_ids) != num_tokens:
        raise InvalidRequestError(
            f"input rows ({num_tokens}) and token ids ({len(token_ids)}) disagree"
        )
    if num_tokens == 0:
        raise InvalidRequestError("scheduler iteration requires at least one token")
    limit = MAX_NATIVE_ITERATION_TOKENS
    if max_iteration_tokens is not None:
        limit = min(max_iteration_tokens, MAX_NATIVE_ITERATION_TOKENS)
    if num_tokens > limit:
        raise InvalidRequestError(
            f"scheduler iteration has {num_tokens} tokens, which exceeds the "
            f"{limit}-token configured iteration limit"
        )
    if positions and len(positions) % num_tokens != 0:
        raise InvalidRequestError("scheduler iteration positions must be empty or token-major")


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
    phase: IterationPhase = IterationPhase.PREFILL
    target_token_count: int | None = None
    """Trim the session to this many tokens first if it is ahead."""
    group: DirectGroup | None = None
    """Run with exactly the other iterations of this group (see :class:`DirectGroup`)."""
    enqueued_at: float = field(default_factory=time.monotonic)
    reply: Future[IterationOutcome] = field(default_factory=Future)

    @property
    def num_tokens(self) -> int:
        if self.input_rows is not None:
            return int(self.input_rows.shape[0])
        return len(self.token_ids)

    def make_runtime_request(self) -> IterationRequest:
        return IterationRequest(
            session_id=self.session_id,
            token_ids=self.token_ids,
            input_rows=self.input_rows,
            positions=self.positions or None,
            sampling=self.sampling,
            sample_last=self.sample_last,
            phase=self.phase,
        )


class _Batchable(Protocol):
    @property
    def session_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

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
        if request.num_tokens > budget and (batch or deferred):
            deferred.append(request)
            continue
        # NOTE: an over-budget head with nothing before it still runs alone; validation
        # keeps this unreachable, but it must never be deferred forever.
        batch.append(request)
        budget -= request.num_tokens
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


def _prepare(runtime: Runtime, batch: list[DirectIteration]) -> list[tuple[DirectIteration, SessionAlignment | None]]:
    """Align sessions that are ahead; returns the requests that can run."""
    runnable = []
    for item in batch:
        try:
            alignment = None
            if item.target_token_count is not None:
                alignment = runtime.align_session_to_token_count_if_ahead(
                    item.session_id, item.target_token_count
                )
        except RuntimeFailure as exc:
            error = worker_error_from_runtime(f"align session {item.session_id}", exc)
            resolve_future(item.reply, error=error)
            continue
        runnable.append((item, alignment))
    return runnable


def _map_samples(output: IterationOutput, num_requests: int) -> dict[int, tuple[int, bool]]:
    """Index samples by request, rejecting malformed outputs."""
    if output.output_rows and len(output.output_rows) != num_requests:
        raise WorkerBackendError(
            f"scheduler iteration returned {len(output.output_rows)} outputs "
            f"for {num_requests} requests"
        )
    samples: dict[int, tuple[int, bool]] = {}
    for sample in output.samples:
        index = sample.request_index
        if not 0 <= index < num_requests:
            raise WorkerBackendError(
                f"scheduler iteration sample references request {index}, "
                f"but only {num_requests} requests ran"
            )
        if index in samples:
            raise WorkerBackendError(
                f"scheduler iteration returned duplicate sample for request {index}"
            )
        samples[index] = (sample.token, sample.is_eog)
    return samples


def run_direct_iteration_batch(
    runtime: Runtime, batch: list[DirectIteration], publish: Publish
) -> int:
    """Run ``batch`` as one runtime call and reply to every caller.

    Caller (the worker thread) has already removed ``batch`` from the queue. Every
    request's future is completed, whatever happens. A :class:`RuntimeFailure` is sent
    to every caller; any other exception is sent too and then re-raised (a bug: the
    worker's panic containment takes over).

    Returns:
        The number of requests that reached the runtime.
    """
    runnable = _prepare(runtime, batch)
    if not runnable:
        return 0
    started = time.monotonic()
    requests = [item.make_runtime_request() for item, _ in runnable]
    try:
        output = runtime.iteration_batch_sampled(requests)
        samples = _map_samples(output, len(requests))
    except (RuntimeFailure, WorkerError) as exc:
        error = exc if isinstance(exc, WorkerError) else worker_error_from_runtime(
            "scheduler iteration", exc
        )
        for item, _ in runnable:
            resolve_future(item.reply, error=error)
        return len(runnable)
    except BaseException:
        for item, _ in runnable:
            resolve_future(item.reply, error=WorkerBackendError("scheduler iteration crashed"))
        raise
    finished = time.monotonic()
    _reply_outcomes(runnable, output, samples, started, finished)
    publish_direct_iteration(publish, runnable, started, finished)
    return len(runnable)


def _reply_outcomes(
    runnable: list[tuple[DirectIteration, SessionAlignment | None]],
    output: IterationOutput,
    samples: dict[int, tuple[int, bool]],
    started: float,
    finished: float,
) -> None:
    run_ms = (finished - started) * 1000.0
    for index, (item, alignment) in enumerate(runnable):
        token, is_eog = samples.get(index, (-1, False))
        rows = output.output_rows[index] if output.output_rows else None
        outcome = IterationOutcome(
            predicted=token,
            is_eog=is_eog,
            output_rows=rows,
            batch_size=len(runnable),
            batch_wait_ms=max(0.0, started - item.enqueued_at) * 1000.0,
            run_ms=run_ms,
            session_alignment=alignment,
        )
        resolve_future(item.reply, outcome)


def publish_direct_iteration(
    publish: Publish,
    runnable: list[tuple[DirectIteration, SessionAlignment | None]],
    started: float,
    finished: float,
) -> None:
    """Emit ``stage.scheduler_feature_iteration``."""
    publish(
        SCHEDULER_DIRECT_ITERATION,
        {
            "skippy.scheduler.batch_size": len(runnable),
            "skippy.scheduler.token_count": sum(item.num_tokens for item, _ in runnable),
            "skippy.scheduler.batch_wait_max_ms": max(
                (started - item.enqueued_at) * 1000.0 for item, _ in runnable
            ),
            "skippy.scheduler.runtime_lock_wait_ms": 0.0,
            "skippy.scheduler.runtime_lock_hold_ms": (finished - started) * 1000.0,
        },
    )
