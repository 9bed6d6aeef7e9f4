"""A later stage's worker role: direct iterations, batched into one runtime call per turn.

:class:`BatchWorker` queues the direct iterations the stage link submits, and each turn:

1. waits up to 2 ms for the next steps of the other active sessions, so they share one
   ``llama_decode`` (never for a lone session, and a decode group only until it is whole);
2. takes one batch off the queue (:func:`~.direct_batch.take_direct_iteration_batch`);
3. answers, without running them, the iterations that were cancelled or whose deadline
   passed while they waited;
4. trims the sessions that are ahead of their iteration (a retracted look-ahead step);
5. runs the rest as one runtime call and answers every caller.

Whatever happens, every iteration taken off the queue is answered: the batch being run
is kept where :meth:`BatchWorker.answer_all` finds it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from skippyd.engine.runtime.contract import (
    IterationOutput,
    IterationSample,
    RuntimeFailure,
    SessionAlignment,
)
from skippyd.engine.telemetry_events import DirectBatchFinished
from skippyd.engine.worker.commands import DropSessionCommand
from skippyd.engine.worker.direct_batch import (
    DIRECT_ITERATION_COALESCE_WINDOW_S,
    DirectIteration,
    IterationOutcome,
    direct_coalesce_target,
    resolve_future,
    take_direct_iteration_batch,
)
from skippyd.engine.worker.worker_errors import (
    WorkerBackendError,
    WorkerError,
    worker_error_from_runtime,
)
from skippyd.engine.worker.worker_stats import WorkerStats

if TYPE_CHECKING:
    from skippyd.engine.worker.command_loop import CommandLoop

logger = logging.getLogger(__name__)

_Runnable = list[tuple[DirectIteration, SessionAlignment | None]]


class BatchWorker:
    """The batch role of a worker; see the module docstring. Worker thread only.

    Args:
        loop: The command loop that runs this role.
    """

    def __init__(self, loop: CommandLoop) -> None:
        self._loop = loop
        self._runtime = loop.runtime
        self.queue: deque[DirectIteration] = deque()
        self._running: list[DirectIteration] = []
        """The batch taken off the queue and not yet answered."""
        self.num_direct_iterations = 0

    # -- the role's face to the command loop ------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.queue)

    def handle(self, command: object) -> None:
        """Queue a direct iteration, or drop a session.

        Raises:
            TypeError: Any other command (a generation worker's).
        """
        if isinstance(command, DirectIteration):
            self.queue.append(command)
        elif isinstance(command, DropSessionCommand):
            try:
                self._runtime.drop_session(command.session_id)
            except RuntimeFailure as exc:
                logger.warning("dropping session %s failed: %s", command.session_id, exc)
        else:
            raise TypeError(f"a batch worker runs no {type(command).__name__}")

    def answer_all(self, error: WorkerError) -> None:
        """Answer the batch being run and every queued iteration with ``error``."""
        for item in self._running:
            resolve_future(item.reply, error=error)
        self._running = []
        while self.queue:
            resolve_future(self.queue.popleft().reply, error=error)

    def snapshot(self, stats: WorkerStats) -> WorkerStats:
        return dataclasses.replace(stats, direct_queue_depth=len(self.queue),
                                   num_direct_iterations=self.num_direct_iterations)

    # -- one turn ---------------------------------------------------------------------------

    def run_turn(self) -> None:
        self._coalesce()
        settings = self._loop.settings
        self._running = take_direct_iteration_batch(
            self.queue, settings.direct_group_batch_size, settings.max_direct_iteration_tokens)
        try:
            self._run(self._running)
        finally:
            self._running = []

    def _coalesce(self) -> None:
        """Wait up to 2 ms for the next steps of the other active sessions."""
        target = direct_coalesce_target(
            self._runtime.active_session_count(), len(self.queue),
            self._loop.settings.direct_group_batch_size, self.queue[0].group)
        deadline = time.monotonic() + DIRECT_ITERATION_COALESCE_WINDOW_S
        while len(self.queue) < target:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._loop.wait_for_command(remaining):
                return

    def _run(self, batch: list[DirectIteration]) -> None:
        """Run ``batch`` as one runtime call; every caller is answered (request-local:
        whatever fails, fails this batch only)."""
        runnable = self._prepare(batch)
        if not runnable:
            return
        self._loop.before_model_call()
        started = time.monotonic()
        requests = [item.make_runtime_request() for item, _ in runnable]
        try:
            self._loop.faults.reach("direct")
            output = self._runtime.run_iteration(requests)
            samples = _map_samples(output, len(requests))
        except (RuntimeFailure, WorkerError) as exc:
            self._answer(runnable, exc if isinstance(exc, WorkerError)
                         else worker_error_from_runtime("scheduler iteration", exc))
            return
        except Exception as exc:
            logger.error("a direct batch of %d failed", len(runnable), exc_info=exc)
            self._answer(runnable, WorkerBackendError(f"scheduler iteration failed: {exc!r}"))
            return
        finished = time.monotonic()
        self.num_direct_iterations += len(runnable)
        _reply_outcomes(runnable, output, samples, started, finished)
        self._publish(runnable, started, finished)

    def _prepare(self, batch: list[DirectIteration]) -> _Runnable:
        """Answer what must not run; align sessions that are ahead; the rest can run."""
        runnable: _Runnable = []
        for item in batch:
            try:
                item.ensure_active()
                alignment = None
                if item.target_token_count is not None:
                    alignment = self._runtime.align_session_to_token_count_if_ahead(
                        item.session_id, item.target_token_count)
            except WorkerError as exc:
                resolve_future(item.reply, error=exc)
                continue
            except RuntimeFailure as exc:
                resolve_future(item.reply, error=worker_error_from_runtime(
                    f"align session {item.session_id}", exc))
                continue
            except Exception as exc:
                logger.error("aligning session %s failed", item.session_id, exc_info=exc)
                resolve_future(item.reply, error=WorkerBackendError(
                    f"align session {item.session_id} failed: {exc!r}"))
                continue
            runnable.append((item, alignment))
        return runnable

    @staticmethod
    def _answer(runnable: _Runnable, error: WorkerError) -> None:
        for item, _ in runnable:
            resolve_future(item.reply, error=error)

    def _publish(self, runnable: _Runnable, started: float, finished: float) -> None:
        """Publish :class:`DirectBatchFinished` (debug: only when someone listens)."""
        telemetry = self._loop.telemetry
        if not telemetry.wants("debug"):
            return
        telemetry.publish(DirectBatchFinished(
            batch_size=len(runnable),
            token_count=sum(item.num_rows for item, _ in runnable),
            batch_wait_max_ms=max((started - item.enqueued_at) * 1000.0
                                  for item, _ in runnable),
            runtime_ms=(finished - started) * 1000.0))


def _map_samples(output: IterationOutput, num_requests: int) -> dict[int, IterationSample]:
    """Index samples by request, rejecting malformed outputs.

    Raises:
        WorkerBackendError: The output does not match the batch.
    """
    if output.output_rows and len(output.output_rows) != num_requests:
        raise WorkerBackendError(
            f"scheduler iteration returned {len(output.output_rows)} outputs "
            f"for {num_requests} requests")
    samples: dict[int, IterationSample] = {}
    for sample in output.samples:
        index = sample.request_index
        if not 0 <= index < num_requests:
            raise WorkerBackendError(
                f"scheduler iteration sample references request {index}, "
                f"but only {num_requests} requests ran")
        if index in samples:
            raise WorkerBackendError(
                f"scheduler iteration returned duplicate sample for request {index}")
        samples[index] = sample
    return samples


def _reply_outcomes(runnable: _Runnable, output: IterationOutput,
                    samples: dict[int, IterationSample], started: float,
                    finished: float) -> None:
    run_ms = (finished - started) * 1000.0
    for index, (item, alignment) in enumerate(runnable):
        sample = samples.get(index)
        rows = output.output_rows[index] if output.output_rows else None
        resolve_future(item.reply, IterationOutcome(
            predicted=-1 if sample is None else sample.token,
            is_eog=sample is not None and sample.is_eog, output_rows=rows,
            batch_size=len(runnable),
            batch_wait_ms=max(0.0, started - item.enqueued_at) * 1000.0, run_ms=run_ms,
            session_alignment=alignment,
            followers=() if sample is None else tuple((f.token, f.is_eog)
                                                      for f in sample.followers),
            drafted=0 if sample is None else sample.drafted))
