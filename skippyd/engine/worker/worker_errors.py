"""The errors a caller of the worker receives, and how runtime failures map to them.

Each carries a stable ``kind`` and a suggested HTTP status, so the API and the stage
link answer a failure the same way wherever it happened.
"""

from __future__ import annotations

from skippyd.engine.runtime.contract import (
    InvalidIterationError,
    KvSlotUnavailableError,
    LanesBusyError,
    RuntimeFailure,
    UnavailableError,
)

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
