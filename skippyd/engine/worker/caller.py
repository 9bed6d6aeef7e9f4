"""Caller-side helpers of the worker handle.

Everything here runs on the caller's thread: the worker thread's ownership (start,
shutdown, join) and the validation of a generation request before anything is queued.
"""

from __future__ import annotations

import logging
import operator
import queue
import threading
from typing import TYPE_CHECKING, Any

from skippyd.engine.runtime.protocol import SamplingConfig
from skippyd.engine.worker.commands import (
    GenerationRequest,
    InvalidRequestError,
    ShutdownCommand,
)

if TYPE_CHECKING:
    from skippyd.engine.worker.thread_loop import Command, WorkerLoop

logger = logging.getLogger(__name__)

#: Name of the worker thread.
THREAD_NAME = "skippy-iteration-scheduler"
#: How long the last owner waits for the Shutdown command to fit in a full queue.
_SHUTDOWN_PUT_TIMEOUT_S = 0.05


class WorkerThread:
    """The worker's thread and command queue, and what stopping them takes."""

    def __init__(self, worker: WorkerLoop, commands: queue.Queue[Command]) -> None:
        self.worker = worker
        self.commands = commands
        self.thread = threading.Thread(target=worker.run, name=THREAD_NAME, daemon=True)
        self.lock = threading.Lock()
        self.num_command_queue_full = 0
        """Commands refused because the bounded queue was full (HTTP 429s)."""

    def count_queue_full(self) -> None:
        with self.lock:
            self.num_command_queue_full += 1

    def release(self) -> None:
        """Send Shutdown and join the worker; runs once, when its handle closes or dies."""
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
