"""The worker thread: commands in, one unit of work per turn out.

A stage has one worker, and its thread is the only code that calls the runtime.
:class:`CommandLoop` is what every worker shares: the bounded command queue and the
overflow inbox, the thread and its loop, the wait hooks, the stats snapshot and the
containment of a failure; what a turn does is its *role*'s business (stage 0:
:class:`~skippyd.engine.worker.generations.GenerationWorker`, a later stage:
:class:`~skippyd.engine.worker.batches.BatchWorker`). A command taken off the queue is
always answered; any other failure in the loop is a bug of unknown extent, so it is
fatal. ``docs/scheduler.md``, *The run loop* and *Failure*, has the loop and the rest.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from skippyd.engine.runtime.contract import Runtime
from skippyd.engine.telemetry_events import RuntimeOperationFinished, WorkerFailed
from skippyd.engine.worker.commands import (
    CancelCommand,
    DropSessionCommand,
    RuntimeOperation,
    ShutdownCommand,
    SubmitCommand,
)
from skippyd.engine.worker.direct_batch import DirectIteration, resolve_future
from skippyd.engine.worker.faults import FaultSwitch
from skippyd.engine.worker.generation_events import ErrorEvent
from skippyd.engine.worker.settings import WorkerSettings
from skippyd.engine.worker.telemetry import (
    TelemetryHub,
)
from skippyd.engine.worker.wait_hooks import WaitHooks
from skippyd.engine.worker.worker_errors import (
    WORKER_PANIC_MESSAGE,
    WorkerBackendError,
    WorkerError,
    WorkerStoppedError,
)
from skippyd.engine.worker.worker_stats import WorkerStats

logger = logging.getLogger(__name__)

#: Name of the worker thread, as thread dumps and tracebacks show it.
THREAD_NAME = "skippyd-worker"
#: Most seconds the stats snapshot lags behind a busy worker (readers: ``skippyd top``,
#: ``/metrics``, the status line); an idle worker publishes at once.
STATS_INTERVAL_S = 0.05
#: How long the last owner waits for the Shutdown command to fit in a full queue.
_SHUTDOWN_PUT_TIMEOUT_S = 0.05

Command = (SubmitCommand | CancelCommand | DirectIteration | DropSessionCommand
           | RuntimeOperation | ShutdownCommand)


class WorkerRole(Protocol):
    """What a turn of the loop runs; the loop owns the thread, the role the work."""

    def has_work(self) -> bool:
        """Whether it holds anything a turn could advance."""

    def handle(self, command: object) -> None:
        """Apply one of its commands."""

    def run_turn(self) -> None:
        """Run one unit of work (one runtime call at most)."""

    def answer_all(self, error: WorkerError) -> None:
        """Answer everything it holds with ``error``; must never raise."""

    def snapshot(self, stats: WorkerStats) -> WorkerStats:
        """``stats`` with the role's own figures."""


def _nothing() -> None:
    pass


class _ShutdownRequested(Exception):
    """Unwinds the run loop from wherever a Shutdown command was received."""


class CommandLoop:
    """The worker's thread, queue and loop; see the module docstring.

    Args:
        runtime: The runtime the worker owns from now on.
        settings: How the worker is sized.
        telemetry: Where it publishes.
        faults: The test fault switch (a disarmed one in production).
    """

    def __init__(self, runtime: Runtime, settings: WorkerSettings, telemetry: TelemetryHub,
                 faults: FaultSwitch | None = None) -> None:
        self.runtime = runtime
        self.settings = settings
        self.telemetry = telemetry
        self.faults = faults if faults is not None else FaultSwitch()
        self.commands: queue.Queue[Command] = queue.Queue(maxsize=settings.command_queue_capacity)
        self.inbox: queue.SimpleQueue[CancelCommand | DropSessionCommand] = queue.SimpleQueue()
        """Cancels and session drops that found the queue full: never lost, applied after
        every drain."""
        self.wait_hooks = WaitHooks()
        """Run before every wait: each model call and each wait for a command."""
        # Right before llama.cpp computes when the runtime can, else before each call.
        self.before_model_call: Callable[[], None] = (
            _nothing if runtime.set_compute_hook(self.wait_hooks.run)
            else self.wait_hooks.run_and_signal)
        self.role: WorkerRole | None = None
        self.failure: str | None = None
        """Why the worker died, or None while it is healthy."""
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self.run, name=THREAD_NAME, daemon=True)
        self.num_command_queue_full = 0
        self.num_runtime_operations = 0
        self.stats = WorkerStats(max_direct_batch_size=settings.max_direct_batch_size)
        self._stats_published_at = 0.0
        self._failure_listeners: list[Callable[[str], None]] = []
        self._listeners_told = False
        self._lock = threading.Lock()

    # -- the thread -------------------------------------------------------------------------

    def run(self) -> None:
        """Thread target: the loop inside its failure containment."""
        try:
            self._run_loop()
        except _ShutdownRequested:
            self._close(WorkerStoppedError())
        except BaseException as exc:  # containment: the worker must not die silently
            self._contain(exc)
        finally:
            try:
                self.publish_stats()
            except Exception:  # the role may be what broke; keep the failure visible
                self.stats = WorkerStats(failure=self.failure)
            self.wait_hooks.run_and_signal()  # the last events (errors of a closing worker) go out
            if self.failure is not None:
                self._tell_listeners(self.failure)

    def _run_loop(self) -> None:
        role = self.role
        assert role is not None, "a command loop needs a role"
        while True:
            if not role.has_work():
                self.publish_stats()
                self.wait_hooks.run_and_signal()
                self._dispatch(self.commands.get())
            self._drain()
            if not role.has_work():
                continue
            role.run_turn()
            if time.monotonic() - self._stats_published_at >= STATS_INTERVAL_S:
                self.publish_stats()

    def _drain(self) -> None:
        for _ in range(self.settings.max_commands_per_turn):
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                break
            self._dispatch(command)
        # After the drain, so an overflowed Cancel never overtakes a Submit drained in
        # the same turn (one still queued is refused when it comes: see the role).
        while not self.inbox.empty():
            self._dispatch(self.inbox.get_nowait())

    def _dispatch(self, command: Command) -> None:
        """Apply one command; one whose handling raises is answered, then the error
        propagates (fatal)."""
        if isinstance(command, ShutdownCommand):
            raise _ShutdownRequested
        if isinstance(command, SubmitCommand):
            self.faults.accept(command.request.request_id)
        elif isinstance(command, DirectIteration):
            self.faults.accept(command.session_id)
        try:
            self.faults.reach("command")
            if isinstance(command, RuntimeOperation):
                self._run_operation(command)
            else:
                assert self.role is not None
                self.role.handle(command)
        except BaseException as exc:
            answer_command(command, WorkerBackendError(f"{WORKER_PANIC_MESSAGE}: {exc!r}"))
            raise

    def wait_for_command(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for one command and apply it; False on timeout."""
        self.wait_hooks.run_and_signal()
        try:
            command = self.commands.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return False
        self._dispatch(command)
        return True

    def _run_operation(self, operation: RuntimeOperation) -> None:
        """Run a caller's closure on the runtime; what it raises is logged, not fatal."""
        self.wait_hooks.run_and_signal()
        started = time.monotonic()
        try:
            operation.fn(self.runtime)
        except Exception as exc:  # the caller's error: nobody waits for it, so log it
            logger.warning("runtime operation %s failed: %s", operation.label, exc)
        self.num_runtime_operations += 1
        if self.telemetry.wants("debug"):
            self.telemetry.publish(RuntimeOperationFinished(
                operation.label, (time.monotonic() - started) * 1000.0))

    # -- stopping ---------------------------------------------------------------------------

    def fail_queued(self, error: WorkerError) -> None:
        """Answer every command still in the queue with ``error``; safe from any thread."""
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            answer_command(command, error)

    def _close(self, error: WorkerError) -> None:
        """Stop for good: answer what the role holds and what is queued."""
        self.closed.set()
        if self.role is not None:
            try:
                self.role.answer_all(error)
            except Exception:  # a role must never raise here; still answer the queue
                logger.exception("answering the requests held failed")
        self.fail_queued(error)

    def _contain(self, exc: BaseException) -> None:
        logger.critical("iteration scheduler worker failed", exc_info=exc)
        self.failure = f"{WORKER_PANIC_MESSAGE}: {exc!r}"
        try:
            self.telemetry.publish(WorkerFailed(repr(exc)))
        finally:
            self._close(WorkerBackendError(self.failure))

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` once the worker has failed, on the worker thread (or
        at once when it already has): it must be quick and never block."""
        with self._lock:
            told = self._listeners_told
            if not told:
                self._failure_listeners.append(listener)
        if told:
            listener(self.failure or "")

    def _tell_listeners(self, reason: str) -> None:
        with self._lock:
            self._listeners_told = True
            listeners, self._failure_listeners = self._failure_listeners, []
        for listener in listeners:
            try:
                listener(reason)
            except Exception:
                logger.exception("worker failure listener failed")

    def release(self) -> None:
        """Send Shutdown and join the thread; runs once, when its handle closes or dies."""
        while self.thread.is_alive():
            try:  # blocking send, but never stuck behind a dead worker
                self.commands.put(ShutdownCommand(), timeout=_SHUTDOWN_PUT_TIMEOUT_S)
                break
            except queue.Full:
                if threading.current_thread() is self.thread:
                    return  # the worker itself cannot wait for room it would make
                continue
        if threading.current_thread() is not self.thread:
            self.thread.join()

    # -- status -----------------------------------------------------------------------------

    def publish_stats(self) -> None:
        """Replace the stats snapshot (one reference assignment: atomic for readers).

        Called when the worker goes idle and at most every :data:`STATS_INTERVAL_S`
        while it is busy: building the snapshot every step would cost a measurable share
        of a small model's step.
        """
        self._stats_published_at = time.monotonic()
        stats = WorkerStats(
            command_queue_depth=self.commands.qsize(),
            active_runtime_sessions=self.runtime.active_session_count(),
            max_direct_batch_size=self.settings.max_direct_batch_size,
            num_runtime_operations=self.num_runtime_operations,
            failure=self.failure,
            kv_cells_used=self.runtime.kv_cells_used(),
        )
        self.stats = stats if self.role is None else self.role.snapshot(stats)


def answer_command(command: Any, error: WorkerError) -> None:
    """Answer a command that will never run (or whose handling failed)."""
    if isinstance(command, SubmitCommand):
        command.answer(ErrorEvent(error))
    elif isinstance(command, DirectIteration):
        resolve_future(command.reply, error=error)
