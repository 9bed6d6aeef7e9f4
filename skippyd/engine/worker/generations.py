"""Stage 0's worker role: planned generations, one batched runtime call per turn.

:class:`GenerationWorker` owns the policy :class:`~skippyd.engine.policy.Scheduler` and
one :class:`~skippyd.engine.worker.record.Generation` per generation it holds, in its one
map ``generations``. A turn (:meth:`GenerationWorker.run_turn`) reads as a story:

1. apply the consumers' answered acknowledgements (a Stop ends its generation);
2. end the generations whose deadline passed (waiting too long for a lane, or admitted and
   making no progress);
3. plan one iteration; tell the generations just admitted;
4. give every newly planned generation its runtime session (and its restored prefix);
5. run the plan as one runtime call (:mod:`~skippyd.engine.worker.plan_execution`);
6. feed the samples back to the policy, send the token events, end the generations the
   policy retired, release generations parked behind a prefix that is now computed;
7. publish the step's telemetry.

Every generation leaves through :meth:`GenerationWorker.retire`, which frees what it holds
(its policy sequence, its prefix-cache lease, its runtime session, its sibling links),
then sends its one final event, whatever happened on the way.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from skippyd.engine.policy import (
    IterationPlan,
    PolicyInputError,
    ScheduledSequence,
    Scheduler,
    SequenceStatus,
    WaitingQueueFullError,
)
from skippyd.engine.policy.counters import IterationTelemetry
from skippyd.engine.prefix_cache import LivePrefixCache
from skippyd.engine.runtime.contract import RuntimeFailure
from skippyd.engine.telemetry_events import RequestAdmitted, RequestFinished, RequestPreempted
from skippyd.engine.worker.arrivals import Arrivals
from skippyd.engine.worker.choice_forks import ChoiceForks
from skippyd.engine.worker.commands import IDLE_POLL_INTERVAL_S, CancelCommand, SubmitCommand
from skippyd.engine.worker.drafting import Speculation, SpeculationSettings
from skippyd.engine.worker.generation_events import (
    AdmittedEvent,
    CompleteEvent,
    ErrorEvent,
    FinalEvent,
    PromptLogprobsEvent,
    TokenAck,
    TokenEvent,
)
from skippyd.engine.worker.plan_execution import PlanExecutor, PlanResult
from skippyd.engine.worker.prefix_admission import NO_CACHE, Admission, PrefixAdmission
from skippyd.engine.worker.record import NOT_ADMITTED, Generation, GenerationStatus
from skippyd.engine.worker.settings import admission_tokens, kv_capacity_tokens
from skippyd.engine.worker.telemetry import step_finished
from skippyd.engine.worker.worker_errors import (
    AdmissionTimeoutError,
    InvalidRequestError,
    QueueFullError,
    RequestCancelledError,
    StalledError,
    WorkerBackendError,
    WorkerError,
    worker_error_from_runtime,
)
from skippyd.engine.worker.worker_stats import LaneInfo, WorkerStats

if TYPE_CHECKING:
    from skippyd.engine.worker.command_loop import CommandLoop

logger = logging.getLogger(__name__)

#: How often the deadlines of held generations are checked while the worker is busy.
DEADLINE_CHECK_INTERVAL_S = 0.1
#: A quiet spell this long, with no request being prepared, ends that wait early: a lone
#: request loses no more than this. One client process sending a burst over fresh
#: connections spaces its requests by up to a few milliseconds.
BURST_QUIET_S = 0.005
#: Generations that finished together in the step that left the worker idle are expected
#: back together (closed-loop clients) if the worker wakes within this many times
#: ``burst_wait_s``.
WAVE_WINDOW = 4
_S = GenerationStatus


class GenerationWorker:
    """The generation role of a worker; see the module docstring. Worker thread only.

    Args:
        loop: The command loop that runs this role (its runtime, settings, telemetry,
            fault switch and the hook to run before each model call).
        prefix_cache: The stage's prefix cache, if it runs one.
        arrivals: Requests the API layer is preparing (a burst the first step waits for).
        speculation: Speculative decoding (drafts on decode rows); off if None.
    """

    def __init__(self, loop: CommandLoop, prefix_cache: LivePrefixCache | None = None,
                 arrivals: Arrivals | None = None,
                 speculation: Speculation | None = None) -> None:
        self._loop = loop
        self._arrivals = arrivals or Arrivals()
        self._runtime = runtime = loop.runtime
        config = loop.settings.policy
        self.scheduler = Scheduler(config)
        self.generations: dict[str, Generation] = {}
        """Every generation the worker holds, by id: the one per-generation map."""
        # One session never holds more than its lane's KV, whatever the pool holds.
        self._kv_capacity = min(kv_capacity_tokens(config), runtime.max_session_tokens)
        self.prefix = None if prefix_cache is None else PrefixAdmission(prefix_cache, runtime)
        self.speculation = speculation or Speculation(SpeculationSettings(), self._kv_capacity)
        self._forks = ChoiceForks(runtime, config.prefill_chunk_tokens)
        self._executor = PlanExecutor(runtime, self.scheduler, loop.faults,
                                      loop.before_model_call, self._reclaim_kept_kv)
        self._early_cancels: OrderedDict[str, None] = OrderedDict()
        """Ids cancelled from the overflow inbox before their Submit was seen."""
        self._next_deadline_check = 0.0
        self._num_completed = 0
        """Generations that ended with a complete answer (not an error or cancel)."""
        self._wave: tuple[int, float, bool] = (0, 0.0, False)
        """How many completed in the step that left the worker idle, when, and whether
        they were everyone the worker held over its last two steps (a whole wave)."""
        self._held_last_turn = 0
        self.last_step_ms = 0.0
        self.last_execution_ms = 0.0

    def _reclaim_kept_kv(self) -> int:
        """Free one idle lane's kept KV when the lanes share a pool; the cells freed."""
        runtime = self._runtime
        if not (runtime.shares_kv_pool and runtime.keeps_lane_kv):
            return 0
        if self.prefix is not None:
            return self.prefix.cache.reclaim_one()
        for lane in runtime.idle_lanes():
            cells = len(runtime.lane_history(lane))
            if cells:
                runtime.clear_lane(lane)
                return cells
        return 0

    # -- the role's face to the command loop ------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.generations)

    def handle(self, command: object) -> None:
        """Apply a Submit or a Cancel.

        Raises:
            TypeError: Any other command (a batch worker's).
        """
        if isinstance(command, SubmitCommand):
            self.submit(command)
        elif isinstance(command, CancelCommand):
            self.cancel(command.req_id, seen_before_submit=command.overflowed)
        else:
            raise TypeError(f"a generation worker runs no {type(command).__name__}")

    def answer_all(self, error: WorkerError) -> None:
        """Answer every held generation with ``error`` at once (the worker is stopping and may
        be broken), then free what can still be freed. Never raises."""
        held = list(self.generations.values())
        self.generations.clear()
        for gen in held:
            gen.end(ErrorEvent(error))
        for gen in held:
            if gen.admitted_at is None:
                continue
            try:
                self._runtime.drop_session(gen.id)
            except Exception as exc:  # after a failure the runtime may be unusable
                logger.warning("freeing the session of %s failed: %r", gen.id, exc)
                return

    def snapshot(self, stats: WorkerStats) -> WorkerStats:
        """``stats`` with this role's figures filled in."""
        metrics = self.scheduler.metrics()
        outside = sum(1 for g in self.generations.values()
                      if g.status in (_S.PARKED, _S.AWAITING_PROMPT))
        return dataclasses.replace(
            stats,
            num_waiting=metrics.waiting_sequences + outside,
            num_active=metrics.active_sequences,
            num_iterations=metrics.iterations,
            num_finished=metrics.finished,
            num_failed=metrics.failed,
            num_cancelled=metrics.cancelled,
            num_rejected=metrics.rejected_overload,
            num_preempted=metrics.preempted,
            num_drafted=self.speculation.num_drafted,
            num_draft_accepted=self.speculation.num_accepted,
            speculation=self.speculation.settings.mode,
            last_step_ms=self.last_step_ms,
            last_execution_ms=self.last_execution_ms,
            last_overhead_ms=max(0.0, self.last_step_ms - self.last_execution_ms),
            step_target_ms=self.scheduler.step_target_us / 1000.0,
            lanes=self._lane_rows(),
        )

    def _lane_rows(self) -> tuple[LaneInfo, ...]:
        rows = []
        for progress in self.scheduler.progress():
            if not progress.replaying:
                phase = "decode"
            else:
                phase = "recompute" if progress.generated_tokens else "prefill"
            lane = self._runtime.lane_of(progress.sequence_id)
            rows.append(LaneInfo(-1 if lane is None else lane, progress.sequence_id, phase,
                                 progress.prompt_tokens, progress.generated_tokens))
        return tuple(rows)

    # -- arriving ---------------------------------------------------------------------------

    def submit(self, command: SubmitCommand) -> None:
        """Take a generation in: route it to the policy, or answer it at once."""
        gen = Generation(command, submitted_at=time.monotonic())
        request = command.request
        if gen.id in self._early_cancels:
            del self._early_cancels[gen.id]
            gen.end(ErrorEvent(RequestCancelledError(f"request {gen.id} was cancelled")))
            return
        if gen.id in self.generations:
            gen.end(ErrorEvent(InvalidRequestError(
                f"a request is already queued or active: {gen.id}")))
            return
        if len(request.prompt_tokens) > self._kv_capacity:
            # It could never be admitted and would wait forever.
            gen.end(ErrorEvent(InvalidRequestError(
                f"request {gen.id} needs {len(request.prompt_tokens)} tokens of KV cache, "
                f"more than the {self._kv_capacity} available")))
            return
        self.generations[gen.id] = gen
        self.speculation.admit(gen)
        first = None if request.fork_of is None else self.generations.get(request.fork_of)
        if first is not None and self._forks.hold(gen, first):
            if ChoiceForks.prompt_computed(first):
                self._release_later_choices(first)
            return
        self._route(gen)

    def _route(self, gen: Generation) -> None:
        """Send a generation into the policy through the prefix cache (it may restore or park)."""
        admission: Admission | None = NO_CACHE
        sampling = gen.request.sampling
        # NOTE: prompt log-probabilities need every prompt row computed: no restore.
        if self.prefix is not None and (sampling is None or sampling.prompt_logprobs is None):
            try:
                self._loop.faults.reach("prefix-cache")
                admission = self.prefix.route(gen, self.generations.values(), self._may_park())
            except Exception as exc:
                self._fail_locally(gen, "prefix cache lookup", exc)
                return
        if admission is not None:  # None: parked behind a leader's shared prefix
            self._enter_policy(gen, admission)

    def _may_park(self) -> bool:
        """Parked generations count against the waiting-queue capacity."""
        parked = sum(1 for g in self.generations.values() if g.status is _S.PARKED)
        waiting = self.scheduler.metrics().waiting_sequences + parked
        return waiting < self.scheduler.config.max_waiting_sequences

    def _enter_policy(self, gen: Generation, admission: Admission) -> None:
        """Submit to the policy; a refusal ends the generation with its error."""
        sequence = self._make_sequence(gen, admission)
        try:
            self.scheduler.submit(sequence)
        except WaitingQueueFullError:
            self.retire(gen, ErrorEvent(QueueFullError()))
            return
        except PolicyInputError as exc:  # an empty prompt, a bad field
            self.retire(gen, ErrorEvent(InvalidRequestError(str(exc))))
            return
        gen.sequence = sequence
        gen.move_to(_S.WAITING)

    def _make_sequence(self, gen: Generation, admission: Admission) -> ScheduledSequence:
        request = gen.request
        # Reserve bounded decode headroom, not the client's whole ceiling.
        reserve = admission_tokens(len(request.prompt_tokens), request.max_tokens,
                                   self._kv_capacity)
        sampling = request.sampling
        if sampling is not None and sampling.grammar is not None:
            # The grammar constrains what follows the prompt (replayed after a preemption).
            sampling = dataclasses.replace(sampling, grammar_start=len(request.prompt_tokens))
        sequence = ScheduledSequence(id=gen.id, prompt_tokens=tuple(request.prompt_tokens),
                            max_tokens=request.max_tokens, sampling=sampling)
        sequence.with_admission_tokens(reserve).with_cache_affinity(admission.affinity)
        if admission.restore is not None:
            sequence.with_prefix_restore(admission.restore)
        return sequence

    def _release_later_choices(self, first: Generation) -> None:
        for gen, admission in ChoiceForks.release(first):
            self._enter_policy(gen, admission)

    def cancel(self, req_id: str, *, seen_before_submit: bool = False) -> None:
        """End a generation its consumer gave up on; idempotent.

        Args:
            req_id: The generation's ``request_id``.
            seen_before_submit: The cancel overtook the queue (it found the queue full):
                an unknown id may still have its Submit queued, which is then refused.
        """
        gen = self.generations.get(req_id)
        if gen is not None:
            self.retire(gen, ErrorEvent(RequestCancelledError(f"request {req_id} was cancelled")))
        elif seen_before_submit:
            self._early_cancels[req_id] = None
            while len(self._early_cancels) > self._loop.settings.command_queue_capacity:
                self._early_cancels.popitem(last=False)

    # -- leaving ------------------------------------------------------------------------------

    def retire(self, gen: Generation, event: FinalEvent) -> None:
        """The one way out: free everything ``gen`` holds, then send its final event.

        The event goes out even if freeing raises (the exception then propagates: a bug
        the command loop contains). Requests that waited on ``gen`` (parked behind it,
        or later choices still waiting for its prompt) are routed again afterwards.
        """
        if gen.finished:
            return
        self._loop.faults.reach("complete")
        orphans: list[Generation] = []
        try:
            if gen.sequence is not None:
                self.scheduler.cancel(gen.id)  # a no-op once the policy retired it itself
            if self.prefix is not None:
                if isinstance(event, CompleteEvent):
                    self.prefix.record_finished(gen)
                else:
                    self.prefix.release(gen)
            if gen.admitted_at is not None:
                self._drop_session(gen)
            self.speculation.forget(gen)
            orphans = self._forks.leave(gen)
            orphans += [g for g in self.generations.values() if g.parked_behind is gen]
        finally:
            if self.generations.get(gen.id) is gen:
                del self.generations[gen.id]
            if isinstance(event, CompleteEvent):
                self._num_completed += 1
                if gen.drafts is not None:
                    stats = gen.drafts.stats
                    event = dataclasses.replace(event, drafted=stats.num_drafted,
                                                accepted=stats.num_accepted)
            gen.end(event)
            self._loop.telemetry.publish(finished_event(gen, event))
        for orphan in orphans:
            orphan.parked_behind = None
            self._route(orphan)

    def _drop_session(self, gen: Generation) -> None:
        try:
            self._runtime.drop_session(gen.id)
        except RuntimeFailure as exc:
            logger.warning("dropping runtime session %s failed: %s", gen.id, exc)
        gen.has_session = False

    def _fail_locally(self, gen: Generation, what: str, exc: Exception) -> None:
        """A failure of one generation: it ends with an error, the worker goes on."""
        if isinstance(exc, RuntimeFailure):
            error = worker_error_from_runtime(f"{what} for {gen.id}", exc)
        else:
            logger.error("%s for %s failed", what, gen.id, exc_info=exc)
            error = WorkerBackendError(f"{what} for {gen.id} failed: {exc!r}")
        self.retire(gen, ErrorEvent(error))

    def fail_all(self, error: WorkerError) -> None:
        """End every held generation with ``error`` (a runtime failure no retry fixes)."""
        for gen in list(self.generations.values()):
            self.retire(gen, ErrorEvent(error))

    # -- one turn ---------------------------------------------------------------------------

    def run_turn(self) -> None:
        """Plan and run one iteration; see the module docstring for the steps."""
        started = time.monotonic()
        completed, held = self._num_completed, len(self.generations)
        try:
            self._run_iteration(started)
        finally:
            if not self.generations:  # idle now: who finished together may come back together
                finished = self._num_completed - completed
                whole = finished == held and self._held_last_turn <= held
                self._wave = (finished, time.monotonic(), whole)
            self._held_last_turn = held

    def _run_iteration(self, started: float) -> None:
        self._apply_acks()
        self._expire(started)
        if not self.generations:
            return
        if not self.scheduler.num_active:
            self._wait_for_burst()
            if not self.generations:  # cancelled meanwhile
                return
        self._loop.faults.reach("plan")
        plan = self.scheduler.plan_iteration()
        if plan.is_empty():
            # Nothing admitted can run and only a command (cancel, submit) can change
            # that: wait for one instead of spinning.
            self._loop.wait_for_command(IDLE_POLL_INTERVAL_S)
            return
        self._note_admissions(plan, started)
        plan = self._prepare_sessions(plan)
        if plan.is_empty():
            return
        plan = self.speculation.attach(plan, self.generations,
                                       self.scheduler.config.max_tokens_per_iteration,
                                       self.scheduler.step_costs)
        try:
            execution = self._executor.execute(plan)
        except RuntimeFailure as exc:
            self.fail_all(worker_error_from_runtime("scheduler iteration", exc))
            return
        for victim in execution.preempted:
            self._note_preempted(victim)
        for req_id, error in execution.failed:
            gen = self.generations.get(req_id)
            if gen is not None:
                self.retire(gen, ErrorEvent(error))
        result = execution.result
        if result is None:
            return
        if not result.isolated:
            # NOTE: works re-run one by one take the sum of their times: fed to the
            # calibration, one bad token id would switch mixed batches off for good.
            self.scheduler.observe_iteration_duration(result.plan, result.execution_s)
            self.speculation.observe(result.plan, result.execution_s, self.generations)
        step = self.scheduler.complete_iteration(result.plan, result.predictions())
        self._deliver(result)
        self._release_parked()
        self._publish_step(step, time.monotonic() - started, result.execution_s)

    def _apply_acks(self) -> None:
        """End the generations whose consumer answered Stop (or vanished); never waits."""
        for gen in [g for g in self.generations.values()
                    if g.pending_acks and g.consumer_stopped()]:
            self.retire(gen, CompleteEvent(gen.finish_reason()))

    def _expire(self, now: float) -> None:
        """End the generations whose admission or stall deadline passed (checked every
        :data:`DEADLINE_CHECK_INTERVAL_S`)."""
        if now < self._next_deadline_check:
            return
        self._next_deadline_check = now + DEADLINE_CHECK_INTERVAL_S
        settings = self._loop.settings
        admission_s, stall_s = settings.admission_timeout_s, settings.stall_timeout_s
        for gen in list(self.generations.values()):
            if gen.finished:
                continue
            if gen.status in NOT_ADMITTED:
                if admission_s > 0 and now - gen.submitted_at >= admission_s:
                    self.retire(gen, ErrorEvent(AdmissionTimeoutError(
                        f"request {gen.id} waited {admission_s:g} s for a lane "
                        "(runtime.admission_timeout_s)")))
            elif stall_s > 0 and now - gen.progressed_at >= stall_s:
                self.retire(gen, ErrorEvent(StalledError(
                    f"request {gen.id} made no progress for {stall_s:g} s "
                    "(runtime.stall_timeout_s)")))

    def _wait_for_burst(self) -> None:
        """Starting from idle, let the generations arriving with this one join its first step.

        Waits while the API layer is still preparing requests, or while fewer generations are
        held than finished together in the step that left the worker idle (their clients
        are likely on their way back), else until a quiet spell of :data:`BURST_QUIET_S`;
        at most ``burst_wait_s`` (worker settings) in all. Nobody is decoding, so only the
        newcomers' first token waits. A wave that is back in full starts at once if it was
        everyone the worker held over its last two steps: nobody who finished a step
        earlier can still be on the way (a lone chat is the common case).
        """
        now, most_s = time.monotonic(), self._loop.settings.burst_wait_s
        wave, idle_since, whole = self._wave
        recent = now - idle_since <= WAVE_WINDOW * most_s
        expected = wave if recent else 0
        self._wave = (0, 0.0, False)
        deadline = now + most_s
        while (remaining := deadline - time.monotonic()) > 0:
            awaited = self._arrivals.pending > 0 or len(self.generations) < expected
            if not awaited and whole and expected:
                return
            wait = remaining if awaited else min(remaining, BURST_QUIET_S)
            if not self._loop.wait_for_command(wait) and not awaited:
                return

    def _note_admissions(self, plan: IterationPlan, now: float) -> None:
        for req_id in plan.admitted_ids:
            gen = self.generations[req_id]
            gen.move_to(_S.PREFILLING)
            gen.progressed_at = now
            if gen.admitted_at is None:
                gen.admitted_at = now
                gen.emit(AdmittedEvent(gen.cached_tokens))
                self._loop.telemetry.publish(RequestAdmitted(
                    gen.id, len(gen.prompt), gen.cached_tokens,
                    (now - gen.submitted_at) * 1000.0))

    def _note_preempted(self, req_id: str) -> None:
        gen = self.generations.get(req_id)
        if gen is not None:
            gen.has_session = False
            gen.move_to(_S.PREEMPTED)
            self._loop.telemetry.publish(RequestPreempted(gen.id, gen.num_generated))

    def _prepare_sessions(self, plan: IterationPlan) -> IterationPlan:
        """Bind a runtime session to every newly planned generation; one that cannot be
        prepared ends alone."""
        dropped: list[str] = []
        chunk_tokens = self.scheduler.config.prefill_chunk_tokens
        for work in plan.work:
            gen = self.generations.get(work.sequence_id)
            if gen is None:  # ended while an earlier work was prepared
                dropped.append(work.sequence_id)
                continue
            if gen.has_session:
                continue
            try:
                self._loop.faults.reach("prepare")
                if self.prefix is not None:
                    self._loop.faults.reach("prefix-cache")
                    self.prefix.bind(gen, chunk_tokens)
                else:
                    self._runtime.ensure_session_active(gen.id)
                    gen.has_session = True
                self._forks.restore(gen)
            except Exception as exc:
                self._fail_locally(gen, "prepare scheduler session", exc)
                dropped.append(work.sequence_id)
        return plan.without_sequences(dropped) if dropped else plan

    def _deliver(self, result: PlanResult) -> None:
        """Send token events, fail rows without a sample, end what the policy retired."""
        now = time.monotonic()
        missing: list[Generation] = []
        gone: list[Generation] = []
        for index, work in enumerate(result.plan.work):
            gen = self.generations.get(work.sequence_id)
            if gen is None:
                continue
            gen.progressed_at = now
            if index in result.prompt_logprobs:
                gen.emit(PromptLogprobsEvent(tuple(result.prompt_logprobs[index])))
            if not work.sample_last:
                continue
            sample = result.samples.get(index)
            if sample is None:
                missing.append(gen)
                continue
            if gen.status is _S.PREFILLING:
                gen.move_to(_S.DECODING)
            if gen.later_choices:
                self._release_later_choices(gen)
            if sample.drafted:
                self.speculation.record(gen, sample.drafted, len(sample.followers))
            # Several tokens when drafts were accepted; the policy kept at most max_tokens.
            for token in sample.tokens:
                if token.is_eog:
                    gen.saw_eog = True  # end of generation: no token event
                    break
                if gen.num_generated >= gen.request.max_tokens:
                    break
                gen.num_generated += 1
                ack = TokenAck()
                gen.pending_acks.append(ack.slot)  # never the ack itself: see TokenAck
                drafts = ((0, 0) if gen.drafts is None else
                          (gen.drafts.stats.num_drafted, gen.drafts.stats.num_accepted))
                if not gen.emit(TokenEvent(token.token, ack, token.logprob, drafts)):
                    gone.append(gen)
                    break
        for gen in missing:
            self.retire(gen, ErrorEvent(WorkerBackendError(
                f"scheduler iteration returned no prediction for {gen.id}")))
        for gen in gone:
            self.retire(gen, ErrorEvent(RequestCancelledError(
                f"the consumer of {gen.id} is gone")))
        for work in result.plan.work:
            gen = self.generations.get(work.sequence_id)
            if (gen is not None and gen.sequence is not None
                    and gen.sequence.status is SequenceStatus.FINISHED):
                self.retire(gen, CompleteEvent(gen.finish_reason()))

    def _release_parked(self) -> None:
        """Route again the parked generations whose shared prefix is now recorded."""
        if self.prefix is None:
            return
        parked = [g for g in self.generations.values() if g.status is _S.PARKED]
        if not parked:
            return
        try:
            self._loop.faults.reach("prefix-cache")
            released = self.prefix.ready_to_release(parked)
        except Exception as exc:
            for gen in parked:
                self._fail_locally(gen, "recording a shared prefix", exc)
            return
        for gen in released:
            gen.parked_behind = None
            self._route(gen)

    def _publish_step(self, step: IterationTelemetry, total_s: float,
                      execution_s: float) -> None:
        """Publish :class:`StepFinished` (debug: only when someone listens)."""
        self.last_step_ms = total_s * 1000.0
        self.last_execution_ms = execution_s * 1000.0
        telemetry = self._loop.telemetry
        if telemetry.wants("debug"):
            telemetry.publish(step_finished(step, self.last_step_ms, self.last_execution_ms))


def finished_event(gen: Generation, event: FinalEvent) -> RequestFinished:
    """The :class:`RequestFinished` of a generation that ends with ``event``."""
    if isinstance(event, CompleteEvent):
        reason, message = event.finish_reason, ""
    else:
        reason, message = event.error.kind, event.error.message
    return RequestFinished(gen.id, reason, len(gen.prompt), gen.num_generated, message)
