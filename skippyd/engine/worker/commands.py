"""Plain types shared by the worker and its callers.

Errors, generation requests, the events a generation receives, the result records of
direct iterations, the worker's status snapshot and the commands other threads send.
Nothing here touches a runtime or a thread.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from skippyd.engine.runtime.contract import (
    InvalidIterationError,
    KvSlotUnavailableError,
    LanesBusyError,
    RuntimeFailure,
    SamplingConfig,
    SessionAlignment,
    TokenLogprob,
    UnavailableError,
)

if TYPE_CHECKING:
    from skippyd.engine.runtime.contract import Runtime

logger = logging.getLogger(__name__)

#: How long the worker waits for a command when nothing it holds can run.
IDLE_POLL_INTERVAL_S = 0.010
#: Seconds a client should wait before retrying an overloaded submit (HTTP Retry-After).
QUEUE_FULL_RETRY_AFTER_S = 1.0

QUEUE_FULL_MESSAGE = "generation queue is full; retry later"
STOPPED_MESSAGE = "iteration scheduler stopped"
WORKER_PANIC_MESSAGE = "iteration scheduler worker panicked"


class WorkerError(Exception):
    """A typed worker failure a caller can map to a protocol error.

    Attributes:
        kind: Stable machine-readable category.
        message: Human-readable text.
        status: Suggested HTTP status code.
        retry_after_s: Suggested retry delay, when retrying makes sense.
    """

    kind = "backend"
    status = 500

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class QueueFullError(WorkerError):
    """The bounded command or waiting queue is full."""

    kind = "overloaded"
    status = 429

    def __init__(self, message: str = QUEUE_FULL_MESSAGE) -> None:
        super().__init__(message, retry_after_s=QUEUE_FULL_RETRY_AFTER_S)


class WorkerStoppedError(WorkerError):
    """The worker is gone or shutting down."""

    kind = "stopped"
    status = 503

    def __init__(self, message: str = STOPPED_MESSAGE) -> None:
        super().__init__(message)


class InvalidRequestError(WorkerError, ValueError):
    """The request itself is malformed; nothing was queued."""

    kind = "invalid_request"
    status = 400


class WorkerBackendError(WorkerError):
    """The runtime failed, or the worker failed while holding the request."""


class RuntimeCapacityError(WorkerError):
    """The runtime had no free lane or KV slot for the work; retrying later may succeed."""

    kind = "overloaded"
    status = 503

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after_s=QUEUE_FULL_RETRY_AFTER_S)


class AdmissionTimeoutError(WorkerError):
    """The request waited for a lane longer than ``runtime.admission_timeout_s``."""

    kind = "overloaded"
    status = 503

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after_s=QUEUE_FULL_RETRY_AFTER_S)


class StalledError(WorkerError):
    """An admitted request made no progress for ``runtime.stall_timeout_s``."""

    kind = "timeout"
    status = 504


class DeadlineExceededError(WorkerError):
    """A direct iteration's deadline passed before (or while) it ran."""

    kind = "timeout"
    status = 504


class RequestCancelledError(WorkerError):
    """The request was cancelled (its consumer went away); nobody reads this error."""

    kind = "cancelled"
    status = 499


class ServiceUnavailableError(WorkerError):
    """A part of the stage's runtime (the downstream pipeline) is unreachable; retry later."""

    kind = "unavailable"
    status = 503

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after_s=QUEUE_FULL_RETRY_AFTER_S)


def worker_error_from_runtime(context: str, exc: RuntimeFailure) -> WorkerError:
    """Map a runtime failure to the typed worker error a caller receives.

    Args:
        context: What was being done, prefixed to the message.
        exc: The runtime's error.
    """
    message = f"{context}: {exc}"
    if isinstance(exc, InvalidIterationError):
        error: WorkerError = InvalidRequestError(message)
    elif isinstance(exc, UnavailableError):
        error = ServiceUnavailableError(message)
    elif isinstance(exc, LanesBusyError | KvSlotUnavailableError):
        error = RuntimeCapacityError(message)
    else:
        error = WorkerBackendError(message)
    error.__cause__ = exc
    return error


@dataclass(slots=True)
class GenerationRequest:
    """A planned generation submitted by a client."""

    request_id: str
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingConfig | None = None
    fork_of: str | None = None
    """Another request with the same prompt, submitted just before this one (the first
    of ``n`` choices): this one copies that request's prompt KV once it is computed
    instead of computing it again."""

    def anon_repr(self) -> str:
        """Describe the request without its tokens (never log prompt text)."""
        return (
            f"GenerationRequest(id={self.request_id!r}, prompt_tokens={len(self.prompt_tokens)}, "
            f"max_tokens={self.max_tokens}, fork_of={self.fork_of!r})"
        )


class TokenControl(enum.Enum):
    """A consumer's answer to one token event."""

    CONTINUE = "continue"
    STOP = "stop"
    DISCONNECTED = "disconnected"
    """Never sent: the channel records it when the consumer dropped the event unanswered."""


class AckSlot:
    """The worker's end of a :class:`TokenAck`: where the answer lands.

    The worker keeps only this, never the :class:`TokenAck` itself, so the ack lives
    exactly as long as the consumer holds the event.
    """

    __slots__ = ("control",)

    def __init__(self) -> None:
        self.control: TokenControl | None = None


class TokenAck:
    """One-slot acknowledgement channel for a token event.

    The consumer calls :meth:`send` once from any thread; the worker polls the
    :attr:`slot` without blocking. A consumer that vanishes (drops the event, or dies
    holding it) without answering leaves :attr:`TokenControl.DISCONNECTED` behind, which
    the worker treats as a stop: nobody reads the rest.
    """

    __slots__ = ("slot", "_lock")

    def __init__(self) -> None:
        self.slot = AckSlot()
        self._lock = threading.Lock()

    def send(self, control: TokenControl) -> bool:
        """Answer the token; returns False (and changes nothing) if already answered.

        Raises:
            TypeError: ``control`` is not a :class:`TokenControl`.
        """
        if not isinstance(control, TokenControl):
            raise TypeError(f"control: expected TokenControl, got {type(control).__name__}")
        with self._lock:
            if self.slot.control is not None:
                return False
            self.slot.control = control
            return True

    def poll(self) -> TokenControl | None:
        """The answer, or None while the consumer has not answered."""
        return self.slot.control

    def __del__(self) -> None:
        # The last reference is gone, so no send() can race this.
        if self.slot.control is None:
            self.slot.control = TokenControl.DISCONNECTED


@dataclass(frozen=True, slots=True)
class AdmittedEvent:
    """The request got a lane: its prompt is computed from now on (sent once)."""

    cached_tokens: int
    """Leading prompt tokens restored from the prefix cache instead of computed."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A generated token; the consumer must answer ``ack`` exactly once."""

    token: int
    ack: TokenAck
    logprob: TokenLogprob | None = None
    """The token's log-probability, when the request's sampling asks for it."""


@dataclass(frozen=True, slots=True)
class PromptLogprobsEvent:
    """Log-probabilities of prompt tokens just computed (``prompt_logprobs`` requests).

    A prompt computed again (after a preemption) reports its positions again.
    """

    entries: tuple[tuple[int, TokenLogprob], ...]
    """(KV position, log-probability) of prompt tokens, in position order."""


@dataclass(frozen=True, slots=True)
class CompleteEvent:
    """The generation ended normally."""

    finish_reason: str
    """``"stop"`` (end of generation or consumer Stop) or ``"length"`` (max_tokens)."""


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """The generation failed or was cancelled; no further events follow."""

    error: WorkerError


FinalEvent = CompleteEvent | ErrorEvent
"""The one event that ends every generation."""
GenerationEvent = AdmittedEvent | TokenEvent | PromptLogprobsEvent | FinalEvent


@dataclass(frozen=True, slots=True)
class IterationOutcome:
    """One caller's share of a direct batched iteration (``SchedulerIterationOutcome``)."""

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


@dataclass(frozen=True, slots=True)
class LaneInfo:
    """One active sequence as the live view shows it."""

    lane: int
    """The runtime lane (sequence id) it holds, or -1 before it has one."""
    request_id: str
    phase: str
    """``prefill``, ``recompute`` or ``decode``."""
    prompt_tokens: int
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """A consistent status snapshot published by the worker once per turn."""

    num_waiting: int = 0
    num_active: int = 0
    command_queue_depth: int = 0
    direct_queue_depth: int = 0
    active_runtime_sessions: int = 0
    max_direct_batch_size: int = 1
    num_iterations: int = 0
    num_finished: int = 0
    num_failed: int = 0
    num_cancelled: int = 0
    num_rejected: int = 0
    """Generations refused because the policy's waiting queue was full."""
    num_command_queue_full: int = 0
    """Commands refused because the bounded command queue was full."""
    num_preempted: int = 0
    num_direct_iterations: int = 0
    num_runtime_operations: int = 0
    last_step_ms: float = 0.0
    last_execution_ms: float = 0.0
    last_overhead_ms: float = 0.0
    step_target_ms: float = 0.0
    """The step time prompt chunks are sized for now (the configured target, stretched
    while prompts queue up); 0 without a target."""
    failure: str | None = None
    lanes: tuple[LaneInfo, ...] = ()
    """Active planned sequences, by request id."""
    kv_cells_used: int = 0
    """KV cells held by the runtime's sessions (0 if the runtime does not say)."""

    @property
    def wave_fullness(self) -> float:
        """Share of the direct batch width occupied by runtime sessions (0..1+)."""
        return self.active_runtime_sessions / max(self.max_direct_batch_size, 1)


# -- commands other threads send to the worker --------------------------------------------
# Direct iterations (``direct_batch.DirectIteration``) are commands themselves.


@dataclass(slots=True)
class SubmitCommand:
    request: GenerationRequest
    on_event: Callable[[GenerationEvent], None]
    answered: bool = False
    """Set once the generation's final event went out (the worker thread only)."""

    def answer(self, event: FinalEvent) -> None:
        """Send the generation's final event, unless it already has one."""
        if self.answered:
            return
        self.answered = True
        try:
            self.on_event(event)
        except Exception:  # the consumer's bug must not reach the worker
            logger.exception("event callback of %s failed", self.request.request_id)


@dataclass(slots=True)
class CancelCommand:
    req_id: str
    overflowed: bool = False
    """It found the command queue full and went to the worker's inbox instead, so it
    may overtake the Submit it cancels."""


@dataclass(slots=True)
class DropSessionCommand:
    """Free a runtime session a later stage of a split pipeline no longer needs."""

    session_id: str


@dataclass(slots=True)
class RuntimeOperation:
    """A closure ``fn(runtime)`` to run on the worker thread, in command order.

    Nobody waits for its result: the worker logs what it raises.
    """

    label: str
    fn: Callable[[Runtime], Any]


class ShutdownCommand:
    """Stop the worker; everything still held fails with "iteration scheduler stopped"."""
