"""``WorkerHandle``: the handle every caller uses to reach the worker thread.

One worker per stage process owns one thread named ``skippy-iteration-scheduler``,
the only code that calls the runtime. Callers never wait on the worker to accept work:
commands go into a bounded queue with non-blocking puts, and a full queue is an
immediate :class:`QueueFullError` (HTTP 429 with a retry hint). Results come back
through callbacks (generations) and futures (direct iterations); no call here blocks on
the worker. :meth:`WorkerHandle.close` stops the worker and joins it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from skippyd.engine.policy import SchedulerConfig
from skippyd.engine.prefix_cache import LivePrefixCache
from skippyd.engine.runtime.protocol import Runtime
from skippyd.engine.worker.caller import WorkerThread, validate_generation_request
from skippyd.engine.worker.commands import (
    CancelCommand,
    GenerationEvent,
    GenerationRequest,
    IterationOutcome,
    QueueFullError,
    RuntimeOperation,
    SubmitCommand,
    WorkerStats,
    WorkerStoppedError,
)
from skippyd.engine.worker.direct_batch import DirectIteration, validate_direct_iteration
from skippyd.engine.worker.settings import WorkerSettings, kv_capacity_tokens
from skippyd.engine.worker.telemetry import TelemetryHub, publish_worker_start
from skippyd.engine.worker.thread_loop import Command, WorkerLoop
from skippyd.engine.worker.wait_hooks import WaitHook

logger = logging.getLogger(__name__)


class WorkerHandle:
    """Handle to the worker thread; starts it at once.

    Args:
        runtime: The runtime the worker will own; nobody else may call it afterwards.
        settings: How the worker is sized (:meth:`WorkerSettings.for_stage`).
        telemetry: Hub to publish to; a private one is created if None.
        prefix_cache: The stage's prefix cache over ``runtime``, driven by the worker.

    Raises:
        TypeError: ``runtime`` does not implement :class:`Runtime`.
    """

    def __init__(
        self,
        runtime: Runtime,
        settings: WorkerSettings,
        *,
        telemetry: TelemetryHub | None = None,
        prefix_cache: LivePrefixCache | None = None,
    ) -> None:
        if not isinstance(runtime, Runtime):
            raise TypeError(f"runtime: {type(runtime).__name__} does not implement Runtime")
        hub = telemetry if telemetry is not None else TelemetryHub()
        publish_worker_start(hub, settings)
        commands: queue.Queue[Command] = queue.Queue(maxsize=settings.command_queue_capacity)
        self.max_session_tokens = min(kv_capacity_tokens(settings.policy),
                                      runtime.max_session_tokens)
        """Most tokens (prompt plus generated) one generation can hold."""
        worker = WorkerLoop(runtime, settings, commands, hub, prefix_cache)
        self._shared = WorkerThread(worker, commands)
        self._shared.thread.start()
        self._finalizer = weakref.finalize(self, self._shared.release)

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
        return self._shared.worker.telemetry

    @property
    def config(self) -> SchedulerConfig:
        return self._shared.worker.planned.scheduler.config

    @property
    def thread(self) -> threading.Thread:
        return self._shared.thread

    def add_wait_hook(self, hook: WaitHook) -> None:
        """Run ``hook`` on the worker thread before each model call and each wait for a
        command; it must be quick and never block, and may return an eventfd for the worker
        to signal (see :mod:`~skippyd.engine.worker.wait_hooks`)."""
        self._shared.worker.wait_hooks.add(hook)

    def remove_wait_hook(self, hook: WaitHook) -> None:
        """Stop running ``hook``. Idempotent."""
        self._shared.worker.wait_hooks.remove(hook)

    @property
    def failure(self) -> str | None:
        """Why the worker died, or None while it is healthy."""
        return self._shared.worker.failure

    def stats(self) -> WorkerStats:
        """The worker's latest published snapshot, plus the live command queue figures."""
        return dataclasses.replace(
            self._shared.worker.stats,
            command_queue_depth=self._shared.commands.qsize(),
            num_command_queue_full=self._shared.num_command_queue_full,
        )

    # -- sending commands ----------------------------------------------------------------

    def _enqueue(self, command: Command) -> None:
        """Put without blocking.

        Raises:
            QueueFullError: The bounded command queue is full.
            WorkerStoppedError: The handle was closed or the worker is gone.
        """
        if not self._finalizer.alive or self._shared.worker.closed.is_set():
            raise WorkerStoppedError()
        try:
            self._shared.commands.put_nowait(command)
        except queue.Full:
            # Nothing may keep the rejected command alive (its closure may hold resources).
            del command
            self._shared.count_queue_full()
            raise QueueFullError() from None
        if self._shared.worker.closed.is_set():
            # The worker stopped between the check and the put: answer what is stranded.
            self._shared.worker.fail_queued(WorkerStoppedError())

    # -- planned generations -------------------------------------------------------------

    def submit_generation(
        self, request: GenerationRequest, on_event: Callable[[GenerationEvent], None]
    ) -> None:
        """Queue a generation; events arrive through ``on_event`` on the worker thread.

        ``on_event`` must not block. For every :class:`TokenEvent` the consumer must call
        ``event.ack.send(TokenControl.CONTINUE or STOP)`` once, from any thread.

        Raises:
            InvalidRequestError: The request is malformed (nothing was queued).
            QueueFullError: The command queue is full; retry after ``retry_after_s``.
            WorkerStoppedError: The worker is stopped.
        """
        validate_generation_request(request, self.max_session_tokens)
        # A caller that retains the runtime already owns an active session (resume).
        self._enqueue(SubmitCommand(request, on_event, runtime_configured=request.retain_runtime))

    def cancel(self, request_id: str) -> None:
        """Stop a generation without an event; non-blocking and idempotent."""
        try:
            self._enqueue(CancelCommand(request_id))
        except QueueFullError:
            # A lost cancel would let the generation run on to max_tokens.
            self._shared.worker.cancel_inbox.put(request_id)
        except WorkerStoppedError:
            pass  # a stopped worker already failed every request

    # -- direct iterations ---------------------------------------------------------------

    def submit_iteration(self, iteration: DirectIteration) -> Future[IterationOutcome]:
        """Validate and queue a direct iteration; returns the worker's reply future.

        Raises:
            InvalidRequestError: Bad shape (nothing was queued).
            QueueFullError: The command queue is full.
            WorkerStoppedError: The worker is stopped.
        """
        validate_direct_iteration(iteration.token_ids, iteration.positions,
                                  self._shared.worker.settings.max_direct_iteration_tokens,
                                  iteration.input_rows)
        self._enqueue(iteration)
        return iteration.reply

    # -- runtime operations --------------------------------------------------------------

    def execute_runtime_detached(self, label: str, fn: Callable[[Runtime], Any]) -> None:
        """Queue ``fn(runtime)`` and return at once; it runs FIFO with later commands.

        Nobody waits for the result: an exception ``fn`` raises is logged, never raised.

        Raises:
            QueueFullError: The command queue is full.
            WorkerStoppedError: The worker is stopped.
        """
        self._enqueue(RuntimeOperation(label, fn))
