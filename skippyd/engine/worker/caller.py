"""Caller-side helpers of the worker handle.

Everything here runs on the caller's thread: request validation before anything is
queued, waiting for a worker reply while watching cancellation, deadline and worker
liveness, and the blocking ``generate`` event loop.
"""

from __future__ import annotations

import logging
import operator
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any, TypeVar

from skippyd.engine.runtime.protocol import SamplingConfig
from skippyd.engine.worker.commands import (
    CANCELLATION_POLL_INTERVAL_S,
    CancellationToken,
    CompleteEvent,
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    RequestCancelledError,
    ShutdownCommand,
    TokenControl,
    TokenEvent,
    WorkerStoppedError,
)

if TYPE_CHECKING:
    from skippyd.engine.worker.handle import WorkerHandle
    from skippyd.engine.worker.thread_loop import Command, WorkerLoop

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Name of the worker thread.
THREAD_NAME = "skippy-iteration-scheduler"
#: How long the last owner waits for the Shutdown command to fit in a full queue.
_SHUTDOWN_PUT_TIMEOUT_S = 0.05


class HandleOwnership:
    """The worker thread and command queue all clones of one handle share.

    ``owner_count`` counts live handles; ``release`` runs once per handle, and the last
    one sends Shutdown with a blocking put and joins the thread.
    """

    def __init__(self, worker: WorkerLoop, commands: queue.Queue[Command]) -> None:
        self.worker = worker
        self.commands = commands
        self.thread = threading.Thread(target=worker.run, name=THREAD_NAME, daemon=True)
        self.owner_count = 1
        self.lock = threading.Lock()
        self.num_command_queue_full = 0
        """Commands refused because the bounded queue was full (HTTP 429s)."""

    def count_queue_full(self) -> None:
        with self.lock:
            self.num_command_queue_full += 1

    def acquire(self) -> None:
        with self.lock:
            if self.owner_count == 0:
                raise WorkerStoppedError()
            self.owner_count += 1

    def release(self) -> None:
        """Drop one owner; the last one sends Shutdown and joins the worker."""
        with self.lock:
            self.owner_count -= 1
            if self.owner_count > 0:
                return
        while self.thread.is_alive():
            try:  # blocking send, but never stuck behind a dead worker
                self.commands.put(ShutdownCommand(), timeout=_SHUTDOWN_PUT_TIMEOUT_S)
                break
            except queue.Full:
                continue
        if threading.current_thread() is not self.thread:
            self.thread.join()


def _check_token_list(tokens: Any, field: str, *, allow_empty: bool) -> None:
    if not isinstance(tokens, list | tuple):
        raise InvalidRequestError(f"{field}: must be a list of token ids")
    if not tokens and not allow_empty:
        raise InvalidRequestError(f"{field}: must contain at least one token")
    for token in tokens:
        try:
            if isinstance(token, bool) or operator.index(token) < 0:
                raise TypeError
        except TypeError:
            raise InvalidRequestError(
                f"{field}: token ids must be non-negative integers (got {token!r})"
            ) from None


def validate_generation_request(request: GenerationRequest, kv_capacity_tokens: int) -> None:
    """Reject a malformed generation before it is queued.

    Raises:
        InvalidRequestError: Naming the first bad field.
    """
    if not isinstance(request, GenerationRequest):
        raise InvalidRequestError(f"request: expected GenerationRequest, got "
                                  f"{type(request).__name__}")
    if not isinstance(request.request_id, str) or not request.request_id:
        raise InvalidRequestError("request_id: must be a non-empty string")
    _check_token_list(request.prompt_tokens, "prompt_tokens", allow_empty=False)
    _check_token_list(request.generated_tokens, "generated_tokens", allow_empty=True)
    for field, value, minimum in (("max_tokens", request.max_tokens, 1),
                                  ("priority", request.priority, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise InvalidRequestError(f"{field}: must be an integer >= {minimum} (got {value!r})")
    if request.sampling is not None:
        if not isinstance(request.sampling, SamplingConfig):
            raise InvalidRequestError("sampling: expected SamplingConfig")
        try:
            request.sampling.validate()
        except ValueError as exc:
            raise InvalidRequestError(f"sampling.{exc}") from None
    needed = len(request.prompt_tokens) + len(request.generated_tokens)
    if needed > kv_capacity_tokens:
        raise InvalidRequestError(
            f"prompt_tokens: {needed} tokens do not fit the {kv_capacity_tokens}-token KV cache"
        )


def wait_for_reply(
    reply: Future[T] | None,
    check: Callable[[], None] | None,
    deadline: float | None,
    worker_thread: threading.Thread,
) -> T:
    """Block until the worker answers, re-checking ``check`` every poll and at the end.

    ``check`` raises when the caller's cancellation or deadline fired; it runs once more
    after the reply arrives, so a deadline that passed while waiting wins even over a
    worker's answer.

    Raises:
        WorkerStoppedError: The worker died without answering.
        Exception: Whatever the worker answered with, or ``check`` raised.
    """
    if reply is None:
        raise RuntimeError("wait_for_reply needs a reply future")
    while True:
        if check is not None:
            check()
        timeout = CANCELLATION_POLL_INTERVAL_S
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - time.monotonic()))
        wait_futures([reply], timeout=timeout)
        if reply.done():
            break
        if not worker_thread.is_alive() and not reply.done():
            raise WorkerStoppedError("iteration scheduler stopped: no reply from the worker")
    if check is not None:
        check()
    return reply.result()


def generate_blocking(
    worker: WorkerHandle,
    request: GenerationRequest,
    cancellation: CancellationToken | None,
    on_token: Callable[[int], TokenControl] | None,
    *,
    resumed: bool,
) -> GenerationResult:
    """Submit ``request`` and drive its events to the end (``drive_generation_events``).

    Raises:
        RequestCancelledError: ``cancellation`` fired (a Cancel was sent).
        WorkerError: The generation failed.
    """
    if threading.current_thread() is worker.thread:
        raise RuntimeError("blocking scheduler calls cannot be made from its worker thread")
    events: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()
    started = time.monotonic()
    first_token_at: float | None = None
    tokens: list[int] = []
    stopped = False
    worker.submit_generation(request, events.put)
    while True:
        event = _next_event(worker, request.request_id, events, cancellation)
        if isinstance(event, TokenEvent) and stopped:
            event.ack.send(TokenControl.STOP)  # produced before the worker saw our Stop
        elif isinstance(event, TokenEvent):
            first_token_at = first_token_at or time.monotonic()
            tokens.append(event.token)
            stopped = _answer_token(worker, request.request_id, event, on_token)
        elif isinstance(event, CompleteEvent):
            elapsed_ms = (time.monotonic() - started) * 1000.0
            prompt_ms = 0.0 if resumed else (
                (first_token_at - started) * 1000.0 if first_token_at else elapsed_ms)
            reason = "stop" if stopped else event.finish_reason
            return GenerationResult(tokens, reason, prompt_ms, max(0.0, elapsed_ms - prompt_ms))
        elif event is not None:
            raise event.error


def _next_event(
    worker: WorkerHandle,
    req_id: str,
    events: queue.SimpleQueue[GenerationEvent],
    cancellation: CancellationToken | None,
) -> GenerationEvent | None:
    """One poll: raise on cancellation or a dead worker; None when nothing arrived."""
    if cancellation is not None and cancellation.is_cancelled:
        worker.cancel(req_id)
        raise RequestCancelledError("request cancelled")
    try:
        return events.get(timeout=CANCELLATION_POLL_INTERVAL_S)
    except queue.Empty:
        if not worker.thread.is_alive() and events.empty():
            raise WorkerStoppedError(
                "iteration scheduler stopped before generation completed"
            ) from None
        return None


def _answer_token(
    worker: WorkerHandle,
    req_id: str,
    event: TokenEvent,
    on_token: Callable[[int], TokenControl] | None,
) -> bool:
    """Ask ``on_token`` and answer the ack; True if the consumer said Stop."""
    try:
        control = on_token(event.token) if on_token is not None else TokenControl.CONTINUE
    except BaseException:
        event.ack.send(TokenControl.STOP)
        worker.cancel(req_id)
        raise
    event.ack.send(control)
    return control is TokenControl.STOP
