"""The worker thread: commands in, one runtime call per turn out.

:class:`WorkerLoop` is the only code that calls the runtime. Each
turn it drains commands, decides between direct iterations and planned generations with
the gates ``docs/scheduler.md`` lists ("The run loop, gate by gate"), and runs exactly
one of them.
Other threads reach it only through its bounded command queue; it publishes a fresh
immutable :class:`WorkerStats` after every turn for anyone to read without locking.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from skippyd.engine.prefix_cache import LivePrefixCache
from skippyd.engine.runtime.protocol import Runtime, install_compute_hook
from skippyd.engine.worker.commands import (
    IDLE_POLL_INTERVAL_S,
    WORKER_PANIC_MESSAGE,
    CancelCommand,
    ErrorEvent,
    LaneInfo,
    RuntimeOperation,
    ShutdownCommand,
    SubmitCommand,
    WorkerBackendError,
    WorkerError,
    WorkerStats,
    WorkerStoppedError,
)
from skippyd.engine.worker.direct_batch import (
    DIRECT_ITERATION_COALESCE_WINDOW_S,
    DirectIteration,
    direct_coalesce_target,
    resolve_future,
    run_direct_iteration_batch,
    should_serve_direct,
    take_direct_iteration_batch,
)
from skippyd.engine.worker.settings import WorkerSettings
from skippyd.engine.worker.telemetry import (
    SCHEDULER_RUNTIME_OPERATION,
    SCHEDULER_WORKER_PANIC,
    TelemetryHub,
)
from skippyd.engine.worker.thread_planned import PlannedGenerations
from skippyd.engine.worker.wait_hooks import WaitHooks

logger = logging.getLogger(__name__)

#: Most seconds the stats snapshot lags behind a busy worker (readers: ``skippyd top``,
#: ``/metrics``, the status line); an idle worker publishes at once.
STATS_INTERVAL_S = 0.05


Command = SubmitCommand | CancelCommand | DirectIteration | RuntimeOperation | ShutdownCommand


def _nothing() -> None:
    pass


class _ShutdownRequested(Exception):
    """Unwinds the run loop from wherever a Shutdown command was received."""


class WorkerLoop:
    """State and loop of the worker thread; see the module docstring.

    Tests may drive one without a thread through :meth:`handle_command` and
    :meth:`run_work_turn`.
    """

    def __init__(
        self,
        runtime: Runtime,
        settings: WorkerSettings,
        commands: queue.Queue[Command],
        telemetry: TelemetryHub,
        prefix_cache: LivePrefixCache | None = None,
    ) -> None:
        self.runtime = runtime
        self.settings = settings
        self.telemetry = telemetry
        self._commands = commands
        self.wait_hooks = WaitHooks()
        """Run before every wait: each model call and each wait for a command."""
        # Right before llama.cpp computes when the runtime can, else before each call.
        self._before_model_call = (_nothing if install_compute_hook(runtime, self.wait_hooks.run)
                                   else self.wait_hooks.run_and_signal)
        self.planned = PlannedGenerations(runtime, settings.policy, telemetry.publish,
                                          self.fail_all, self._refresh_active_sessions,
                                          prefix_cache, self._before_model_call)
        self.direct: deque[DirectIteration] = deque()
        self.active_runtime_sessions = 0
        self.last_served_direct = False
        self.failure: str | None = None
        self.closed = threading.Event()
        self.cancel_inbox: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.num_direct_iterations = 0
        self.num_runtime_operations = 0
        self.stats = WorkerStats(max_direct_batch_size=settings.max_direct_batch_size)
        self._stats_published_at = 0.0

    # -- thread entry and the loop ------------------------------------------------------

    def run(self) -> None:
        """Thread target: the loop inside a panic guard."""
        try:
            self.run_loop()
        except _ShutdownRequested:
            self._close(WorkerStoppedError())
        except BaseException as exc:  # panic containment: the worker must not die silently
            self._contain_panic(exc)
        finally:
            try:
                self.publish_stats()
            except Exception:  # the policy may be what broke; keep the failure visible
                self.stats = WorkerStats(failure=self.failure)
            self.wait_hooks.run_and_signal()  # the last events (errors of a closing worker) go out

    def run_loop(self) -> None:
        """Idle wait, drain, gates, one work turn; until a Shutdown command."""
        while True:
            if self._is_idle():
                self.publish_stats()
                self.wait_hooks.run_and_signal()
                self._dispatch(self._commands.get())
            self._drain_commands()
            if self._is_idle():
                continue
            if self.direct:
                self._coalesce_direct_iterations()
            self.run_work_turn()
            if time.monotonic() - self._stats_published_at >= STATS_INTERVAL_S:
                self.publish_stats()
            if self.settings.iteration_interval_s > 0:
                self._wait_for_command(self.settings.iteration_interval_s)

    def _is_idle(self) -> bool:
        return not self.planned.requests and not self.direct

    def _dispatch(self, command: Command) -> None:
        if isinstance(command, ShutdownCommand):
            raise _ShutdownRequested
        self.handle_command(command)

    def _drain_commands(self) -> None:
        for _ in range(self.settings.max_commands_per_turn):
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            self._dispatch(command)
        # Cancels that found the command queue full; after the drain so a Cancel never
        # overtakes the Submit it targets when both were drained in this turn.
        while not self.cancel_inbox.empty():
            self.planned.cancel(self.cancel_inbox.get_nowait())

    def _wait_for_command(self, timeout_s: float) -> None:
        self.wait_hooks.run_and_signal()
        try:
            command = self._commands.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return
        self._dispatch(command)

    def _coalesce_direct_iterations(self) -> None:
        """Wait up to 2 ms for the next steps of the other active direct sessions.

        NOTE: only called with direct work queued; the original also waited on
        planned-only turns once sessions were active, adding 2 ms to every planned step.
        """
        planned_sessions = sum(1 for s in self.planned.requests.values() if s.runtime_configured)
        target = direct_coalesce_target(
            max(0, self.active_runtime_sessions - planned_sessions), len(self.direct),
            self.settings.direct_group_batch_size, self.direct[0].group,
        )
        deadline = time.monotonic() + DIRECT_ITERATION_COALESCE_WINDOW_S
        if len(self.direct) < target:
            self.wait_hooks.run_and_signal()
        while len(self.direct) < target:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                command = self._commands.get(timeout=remaining)
            except queue.Empty:
                return
            self._dispatch(command)

    # -- commands -------------------------------------------------------------------------

    def handle_command(self, command: Command) -> None:
        """Apply one command; Shutdown is handled by the loop and ignored here."""
        if isinstance(command, SubmitCommand):
            self.planned.submit(command.request, command.on_event, command.runtime_configured)
        elif isinstance(command, DirectIteration):
            self.direct.append(command)
        elif isinstance(command, RuntimeOperation):
            # Inline, in command order: FIFO with every other command.
            self.run_runtime_operation(command)
        elif isinstance(command, CancelCommand):
            self.planned.cancel(command.req_id)

    # -- one work turn -------------------------------------------------------------------

    def run_work_turn(self) -> None:
        """Serve one unit of work: a direct batch or a planned iteration."""
        if self.direct or self.planned.requests:
            self.run_iteration()

    def run_iteration(self) -> None:
        """Alternate direct batches and planned iterations."""
        self.planned.apply_pending_controls()
        # Decide before planning: planning advances cursors and must only happen when
        # the plan will run.
        if should_serve_direct(bool(self.direct), bool(self.planned.requests),
                               self.last_served_direct):
            self.last_served_direct = True
            self._run_direct_batch()
            return
        if self.planned.run_iteration():
            self.last_served_direct = False
            self._refresh_active_sessions()
        elif self.direct:
            # NOTE: the empty plan ran nothing; the original then kept its turn flag and
            # could starve queued direct work behind requests that cannot be admitted.
            self.last_served_direct = True
            self._run_direct_batch()
        else:
            # Nothing admitted can run and only a command (cancel, submit) can change
            # that: wait for one instead of spinning.
            self._wait_for_command(IDLE_POLL_INTERVAL_S)

    def _run_direct_batch(self) -> None:
        batch = take_direct_iteration_batch(
            self.direct, self.settings.direct_group_batch_size,
            self.settings.max_direct_iteration_tokens,
        )
        self._before_model_call()
        self.num_direct_iterations += run_direct_iteration_batch(
            self.runtime, batch, self.telemetry.publish
        )
        self._refresh_active_sessions()

    def run_runtime_operation(self, operation: RuntimeOperation) -> None:
        """Run a caller's closure on the runtime; what it raises is logged, not fatal."""
        self.wait_hooks.run_and_signal()
        started = time.monotonic()
        try:
            operation.fn(self.runtime)
        except Exception as exc:  # the caller's error: nobody waits for it, so log it
            logger.warning("runtime operation %s failed: %s", operation.label, exc)
        run_s = time.monotonic() - started
        self.num_runtime_operations += 1
        self._refresh_active_sessions()
        self.telemetry.publish(SCHEDULER_RUNTIME_OPERATION, {
            "skippy.scheduler.operation": operation.label,
            "skippy.scheduler.operation_ms": run_s * 1000.0,
        })

    def _refresh_active_sessions(self) -> None:
        self.active_runtime_sessions = self.runtime.active_session_count()

    # -- failure paths ---------------------------------------------------------------------

    def fail_all(self, error: WorkerError) -> None:
        """Fail every held generation and every queued direct iteration."""
        self.planned.fail_all(error)
        while self.direct:
            resolve_future(self.direct.popleft().reply, error=error)

    def fail_queued(self, error: WorkerError) -> None:
        """Answer every command still in the queue with ``error``; safe from any thread."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            fail_command(command, error)

    def _close(self, error: WorkerError) -> None:
        """Stop for good: fail what is held and what is queued."""
        self.closed.set()
        try:
            self.fail_all(error)
        except Exception:
            # After a panic the runtime may be unusable: still answer every caller.
            logger.exception("failing held requests touched a broken runtime")
            for state in self.planned.requests.values():
                state.emit(ErrorEvent(error))
            self.planned.requests.clear()
            while self.direct:
                resolve_future(self.direct.popleft().reply, error=error)
        self.fail_queued(error)

    def _contain_panic(self, exc: BaseException) -> None:
        logger.critical("iteration scheduler worker panicked", exc_info=exc)
        self.failure = f"{WORKER_PANIC_MESSAGE}: {exc!r}"
        self.telemetry.publish(SCHEDULER_WORKER_PANIC, {
            "skippy.scheduler.failure_contained": True,
            "skippy.scheduler.failure": repr(exc),
        })
        self._close(WorkerBackendError(WORKER_PANIC_MESSAGE))

    def publish_stats(self) -> None:
        """Replace the stats snapshot (one reference assignment: atomic for readers).

        Called when the worker goes idle and at most every :data:`STATS_INTERVAL_S`
        while it is busy: building the snapshot every step cost about 1 % of a step.
        """
        self._stats_published_at = time.monotonic()
        metrics = self.planned.scheduler.metrics()
        self.stats = WorkerStats(
            num_waiting=metrics.waiting_sequences + self.planned.num_parked,
            num_active=metrics.active_sequences,
            command_queue_depth=self._commands.qsize(),
            direct_queue_depth=len(self.direct),
            active_runtime_sessions=self.active_runtime_sessions,
            max_direct_batch_size=self.settings.max_direct_batch_size,
            num_iterations=metrics.iterations,
            num_finished=metrics.finished,
            num_failed=metrics.failed,
            num_cancelled=metrics.cancelled,
            num_rejected=metrics.rejected_overload,
            num_preempted=metrics.preempted,
            num_direct_iterations=self.num_direct_iterations,
            num_runtime_operations=self.num_runtime_operations,
            last_step_ms=self.planned.last_step_ms,
            last_execution_ms=self.planned.last_execution_ms,
            last_overhead_ms=max(0.0, self.planned.last_step_ms - self.planned.last_execution_ms),
            step_target_ms=self.planned.scheduler.step_target_us / 1000.0,
            failure=self.failure,
            lanes=self._lane_rows(),
            kv_cells_used=self.runtime.kv_cells_used(),
        )

    def _lane_rows(self) -> tuple[LaneInfo, ...]:
        rows = []
        for progress in self.planned.scheduler.progress():
            if not progress.replaying:
                phase = "decode"
            else:
                phase = "recompute" if progress.generated_tokens else "prefill"
            lane = self.runtime.session_seq_id(progress.sequence_id)
            rows.append(LaneInfo(-1 if lane is None else lane, progress.sequence_id, phase,
                                 progress.prompt_tokens, progress.generated_tokens))
        return tuple(rows)


def fail_command(command: Command, error: WorkerError) -> None:
    """Answer a command that will never run."""
    if isinstance(command, SubmitCommand):
        try:
            command.on_event(ErrorEvent(error))
        except Exception:
            logger.exception("event callback of %s failed", command.request.request_id)
    elif isinstance(command, DirectIteration):
        resolve_future(command.reply, error=error)

