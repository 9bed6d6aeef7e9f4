"""The handles callers use to reach a worker thread.

One worker per stage process owns one thread, the only code that calls the runtime.
Callers never wait on the worker to accept work: commands go into a bounded queue with
non-blocking puts, and a full queue is an immediate :class:`QueueFullError` (HTTP 429
with a retry hint). Results come back through callbacks (generations) and futures
(direct iterations); no call here blocks on the worker.

Each stage role has its handle: :class:`GenerationHandle` (stage 0: generations) and
:class:`BatchHandle` (a later stage of a split pipeline: direct iterations). Both start
their worker at once; :meth:`WorkerHandle.close` stops it and joins it.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from skippyd.engine.policy import SchedulerConfig
from skippyd.engine.prefix_cache import LivePrefixCache
from skippyd.engine.runtime.contract import Runtime, SamplingConfig
from skippyd.engine.worker.arrivals import Arrivals
from skippyd.engine.worker.batches import BatchWorker
from skippyd.engine.worker.command_loop import Command, CommandLoop
from skippyd.engine.worker.commands import (
    CancelCommand,
    DropSessionCommand,
    RuntimeOperation,
    SubmitCommand,
)
from skippyd.engine.worker.direct_batch import (
    DirectIteration,
    IterationOutcome,
    validate_direct_iteration,
)
from skippyd.engine.worker.drafting import Speculation
from skippyd.engine.worker.faults import FaultSwitch
from skippyd.engine.worker.generation_events import GenerationEvent, GenerationRequest
from skippyd.engine.worker.generations import GenerationWorker
from skippyd.engine.worker.settings import WorkerSettings, kv_capacity_tokens
from skippyd.engine.worker.telemetry import TelemetryHub, publish_worker_start
from skippyd.engine.worker.wait_hooks import WaitHook
from skippyd.engine.worker.worker_errors import (
    InvalidRequestError,
    QueueFullError,
    WorkerStoppedError,
)
from skippyd.engine.worker.worker_stats import WorkerStats

logger = logging.getLogger(__name__)


class WorkerHandle:
    """What every worker handle offers; build a :class:`GenerationHandle` or a
    :class:`BatchHandle`.

    Raises:
        TypeError: ``runtime`` does not implement :class:`Runtime`.
    """

    def __init__(self, runtime: Runtime, settings: WorkerSettings,
                 telemetry: TelemetryHub | None, faults: FaultSwitch | None) -> None:
        if not isinstance(runtime, Runtime):
            raise TypeError(f"runtime: {type(runtime).__name__} does not implement Runtime")
        hub = telemetry if telemetry is not None else TelemetryHub()
        publish_worker_start(hub, settings)
        self._loop = CommandLoop(runtime, settings, hub, faults)

    def _start(self) -> None:
        self._loop.thread.start()
        self._finalizer = weakref.finalize(self, self._loop.release)

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker (failing what it holds) and join its thread. Idempotent."""
        self._finalizer()

    def __enter__(self) -> WorkerHandle:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- status (never blocks on the worker) ---------------------------------------------

    @property
    def telemetry(self) -> TelemetryHub:
        return self._loop.telemetry

    @property
    def settings(self) -> WorkerSettings:
        return self._loop.settings

    @property
    def thread(self) -> threading.Thread:
        return self._loop.thread

    def add_wait_hook(self, hook: WaitHook) -> None:
        """Run ``hook`` on the worker thread before each model call and each wait for a
        command; it must be quick and never block, and may return an eventfd for the worker
        to signal (see :mod:`~skippyd.engine.worker.wait_hooks`)."""
        self._loop.wait_hooks.add(hook)

    def remove_wait_hook(self, hook: WaitHook) -> None:
        """Stop running ``hook``. Idempotent."""
        self._loop.wait_hooks.remove(hook)

    @property
    def failure(self) -> str | None:
        """Why the worker died, or None while it is healthy."""
        return self._loop.failure

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` once, from the worker thread, when the worker fails
        (at once if it already has). It must be quick and never block."""
        self._loop.on_failure(listener)

    def stats(self) -> WorkerStats:
        """The worker's latest published snapshot, plus the live command queue figures."""
        return dataclasses.replace(
            self._loop.stats,
            command_queue_depth=self._loop.commands.qsize(),
            num_command_queue_full=self._loop.num_command_queue_full,
        )

    # -- sending commands ----------------------------------------------------------------

    def _enqueue(self, command: Command) -> None:
        """Put without blocking.

        Raises:
            QueueFullError: The bounded command queue is full.
            WorkerStoppedError: The handle was closed or the worker is gone.
        """
        loop = self._loop
        if not self._finalizer.alive or loop.closed.is_set():
            raise WorkerStoppedError()
        try:
            loop.commands.put_nowait(command)
        except queue.Full:
            # Nothing may keep the rejected command alive (its closure may hold resources).
            del command
            with loop._lock:
                loop.num_command_queue_full += 1
            raise QueueFullError() from None
        if loop.closed.is_set():
            # The worker stopped between the check and the put: answer what is stranded.
            loop.fail_queued(WorkerStoppedError())

    def _enqueue_or_inbox(self, command: CancelCommand | DropSessionCommand) -> None:
        """Queue a command that must never be lost: with the queue full it goes to the
        worker's inbox, applied after its next drain. A stopped worker needs none."""
        try:
            self._enqueue(command)
        except QueueFullError:
            if isinstance(command, CancelCommand):
                command.overflowed = True
            self._loop.inbox.put(command)
        except WorkerStoppedError:
            pass

    def execute_runtime_detached(self, label: str, fn: Callable[[Runtime], Any]) -> None:
        """Queue ``fn(runtime)`` and return at once; it runs FIFO with later commands.

        Nobody waits for the result: an exception ``fn`` raises is logged, never raised.

        Raises:
            QueueFullError: The command queue is full.
            WorkerStoppedError: The worker is stopped.
        """
        self._enqueue(RuntimeOperation(label, fn))


class GenerationHandle(WorkerHandle):
    """The handle of stage 0's worker: generations planned by the policy.

    Args:
        runtime: The runtime the worker will own; nobody else may call it afterwards.
        settings: How the worker is sized (:meth:`WorkerSettings.for_stage`).
        telemetry: Hub to publish to; a private one is created if None.
        prefix_cache: The stage's prefix cache over ``runtime``, driven by the worker.
        faults: The test fault switch (``SKIPPYD_FAULT``); none by default.
        arrivals: Requests the API layer is preparing, which a worker starting from idle
            waits a moment for; a private counter nobody feeds if None.
        speculation: Speculative decoding; off if None.
    """

    def __init__(self, runtime: Runtime, settings: WorkerSettings, *,
                 telemetry: TelemetryHub | None = None,
                 prefix_cache: LivePrefixCache | None = None,
                 faults: FaultSwitch | None = None,
                 arrivals: Arrivals | None = None,
                 speculation: Speculation | None = None) -> None:
        super().__init__(runtime, settings, telemetry, faults)
        self._role = GenerationWorker(self._loop, prefix_cache, arrivals, speculation)
        self._loop.role = self._role
        self.max_session_tokens = min(kv_capacity_tokens(settings.policy),
                                      runtime.max_session_tokens)
        """Most tokens (prompt plus generated) one generation can hold."""
        self._start()

    @property
    def config(self) -> SchedulerConfig:
        return self._role.scheduler.config

    def submit_generation(
        self, request: GenerationRequest, on_event: Callable[[GenerationEvent], None]
    ) -> None:
        """Queue a generation; events arrive through ``on_event`` on the worker thread.

        ``on_event`` must not block. Exactly one final event (``CompleteEvent`` or
        ``ErrorEvent``) ends every accepted generation. For every ``TokenEvent`` the
        consumer must call ``event.ack.send(TokenControl.CONTINUE or STOP)`` once, from
        any thread.

        Raises:
            InvalidRequestError: The request is malformed (nothing was queued).
            QueueFullError: The command queue is full; retry after ``retry_after_s``.
            WorkerStoppedError: The worker is stopped.
        """
        validate_generation_request(request, self.max_session_tokens)
        self._enqueue(SubmitCommand(request, on_event))

    def cancel(self, request_id: str) -> None:
        """End a generation; its final event is a cancellation error nobody needs to read.
        Never blocks, never fails, idempotent."""
        self._enqueue_or_inbox(CancelCommand(request_id))


class BatchHandle(WorkerHandle):
    """The handle of a later stage's worker: direct iterations from the stage link.

    Args:
        runtime: The runtime the worker will own; nobody else may call it afterwards.
        settings: How the worker is sized (:meth:`WorkerSettings.for_stage`).
        telemetry: Hub to publish to; a private one is created if None.
        faults: The test fault switch (``SKIPPYD_FAULT``); none by default.
    """

    def __init__(self, runtime: Runtime, settings: WorkerSettings, *,
                 telemetry: TelemetryHub | None = None,
                 faults: FaultSwitch | None = None) -> None:
        super().__init__(runtime, settings, telemetry, faults)
        self._loop.role = BatchWorker(self._loop)
        self._start()

    def submit_iteration(self, iteration: DirectIteration) -> Future[IterationOutcome]:
        """Validate and queue a direct iteration; returns the worker's reply future.

        Raises:
            InvalidRequestError: Bad shape (nothing was queued).
            WorkerError: It was cancelled or is past its deadline already (nothing was
                queued).
            QueueFullError: The command queue is full.
            WorkerStoppedError: The worker is stopped.
        """
        validate_direct_iteration(iteration.token_ids, iteration.positions,
                                  self._loop.settings.max_direct_iteration_tokens,
                                  iteration.input_rows, iteration.draft)
        iteration.ensure_active()
        self._enqueue(iteration)
        return iteration.reply

    def drop_session(self, session_id: str) -> None:
        """Free a runtime session after every command queued before this call. Never
        blocks, never fails: with the queue full it is applied after the worker's next
        drain (so it may overtake the session's own queued iterations: wait for those
        first). Idempotent."""
        self._enqueue_or_inbox(DropSessionCommand(session_id))


def _check_token_list(tokens: Any, field: str) -> None:
    if not isinstance(tokens, list | tuple):
        raise InvalidRequestError(f"{field}: must be a list of token ids")
    if not tokens:
        raise InvalidRequestError(f"{field}: must contain at least one token")
    for token in tokens:
        try:
            if isinstance(token, bool) or operator.index(token) < 0:
                raise TypeError
        except TypeError:
            raise InvalidRequestError(
                f"{field}: token ids must be non-negative integers (got {token!r})"
            ) from None


def validate_generation_request(request: GenerationRequest, max_session_tokens: int) -> None:
    """Reject a malformed generation before it is queued.

    Raises:
        InvalidRequestError: Naming the first bad field.
    """
    if not isinstance(request, GenerationRequest):
        raise InvalidRequestError(f"request: expected GenerationRequest, got "
                                  f"{type(request).__name__}")
    if not isinstance(request.request_id, str) or not request.request_id:
        raise InvalidRequestError("request_id: must be a non-empty string")
    _check_token_list(request.prompt_tokens, "prompt_tokens")
    value = request.max_tokens
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError(f"max_tokens: must be an integer >= 1 (got {value!r})")
    if request.sampling is not None:
        if not isinstance(request.sampling, SamplingConfig):
            raise InvalidRequestError("sampling: expected SamplingConfig")
        try:
            request.sampling.validate()
        except ValueError as exc:
            raise InvalidRequestError(f"sampling.{exc}") from None
    if len(request.prompt_tokens) > max_session_tokens:
        raise InvalidRequestError(
            f"prompt_tokens: {len(request.prompt_tokens)} tokens do not fit the "
            f"{max_session_tokens}-token KV cache")
