"""Planned generations on the worker thread.

:class:`PlannedGenerations` owns the policy :class:`~skippyd.engine.policy.Scheduler` and
the per-request state of every generation it admitted. Each planned turn it plans one
iteration, prepares runtime sessions, runs the plan as exactly one batched runtime call
(see :mod:`skippyd.engine.worker.thread_execute`), feeds the samples back to the policy, and
turns them into token events whose acknowledgements are polled, never awaited.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from skippyd.engine.policy import (
    IterationPlan,
    PolicyInputError,
    Scheduler,
    SchedulerConfig,
    Sequence,
)
from skippyd.engine.policy import QueueFullError as PolicyQueueFullError
from skippyd.engine.policy.telemetry import IterationTelemetry
from skippyd.engine.prefix_cache import LivePrefixCache
from skippyd.engine.runtime.protocol import Runtime, RuntimeFailure
from skippyd.engine.worker.commands import (
    CompleteEvent,
    ErrorEvent,
    GenerationEvent,
    GenerationRequest,
    InvalidRequestError,
    PromptLogprobsEvent,
    QueueFullError,
    TokenAck,
    TokenEvent,
    WorkerBackendError,
    WorkerError,
    worker_error_from_runtime,
)
from skippyd.engine.worker.settings import admission_tokens, kv_capacity_tokens
from skippyd.engine.worker.telemetry import SCHEDULER_ITERATION
from skippyd.engine.worker.thread_cache import Admission, PrefixCacheFlow
from skippyd.engine.worker.thread_execute import PlanExecutor, PlanResult, step_attributes
from skippyd.engine.worker.thread_forks import ChoiceForks
from skippyd.engine.worker.thread_state import RequestState, consumer_stopped

logger = logging.getLogger(__name__)

Publish = Callable[[str, Mapping[str, Any]], None]


class PlannedGenerations:
    """Policy scheduler plus request map; only the worker thread calls it.

    Args:
        runtime: The runtime (worker thread only).
        config: Normalized policy configuration.
        publish: Telemetry sink.
        fail_everything: Called with an error when the runtime failed in a way that
            leaves no request safe.
        on_sessions_dropped: Called after runtime sessions were dropped.
        prefix_cache: The stage's prefix cache, if it runs one (see ``thread_cache``).
        before_model_call: Runs right before each runtime call of a planned iteration.
    """

    def __init__(
        self,
        runtime: Runtime,
        config: SchedulerConfig,
        publish: Publish,
        fail_everything: Callable[[WorkerError], None],
        on_sessions_dropped: Callable[[], None],
        prefix_cache: LivePrefixCache | None = None,
        before_model_call: Callable[[], None] = lambda: None,
    ) -> None:
        self.runtime = runtime
        self.scheduler = Scheduler(config)
        self.requests: dict[str, RequestState] = {}
        # One session never holds more than its lane's KV, whatever the pool holds.
        self._kv_capacity = min(kv_capacity_tokens(self.scheduler.config),
                                runtime.max_session_tokens)
        self._publish = publish
        self._fail_everything = fail_everything
        self._on_sessions_dropped = on_sessions_dropped
        self.prefix_flow = None if prefix_cache is None else PrefixCacheFlow(
            prefix_cache, runtime, self.scheduler,
            lambda: {i: s.request.prompt_tokens for i, s in self.requests.items()})
        self.forks = ChoiceForks(runtime, self.scheduler.config.prefill_chunk_tokens)
        self._executor = PlanExecutor(
            runtime, self.scheduler, self._release_preempted, self.fail_request,
            before_model_call)
        self._last_lifecycle = (0, 0, 0, 0)
        self.last_step_ms = 0.0
        self.last_execution_ms = 0.0

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_parked(self) -> int:
        """Requests waiting outside the policy for a leader's shared prefix or prompt."""
        parked = 0 if self.prefix_flow is None else len(self.prefix_flow.parked)
        return parked + self.forks.num_waiting

    # -- commands ----------------------------------------------------------------------

    def submit(
        self,
        request: GenerationRequest,
        on_event: Callable[[GenerationEvent], None],
        runtime_configured: bool,
    ) -> None:
        """Admit a generation into the policy, or answer with an ``ErrorEvent``."""
        state = RequestState(request, on_event, runtime_configured, len(request.generated_tokens))
        replay_tokens = len(request.prompt_tokens) + len(request.generated_tokens)
        if replay_tokens > self._kv_capacity:
            # It could never be admitted and would wait forever.
            state.emit(ErrorEvent(InvalidRequestError(
                f"request {request.request_id} needs {replay_tokens} tokens of KV cache, "
                f"more than the {self._kv_capacity} available"
            )))
            return
        if (request.fork_of is not None and request.request_id not in self.requests
                and self._hold_follower(state)):
            return
        self._route(state)

    def _route(self, state: RequestState) -> None:
        """Admit a fresh request through the prefix cache (it may restore or park)."""
        request = state.request
        flow = self.prefix_flow
        # NOTE: prompt log-probabilities need every prompt row computed: no restore.
        if (flow is None or request.generated_tokens or state.runtime_configured
                or (request.sampling is not None and request.sampling.prompt_logprobs is not None)):
            self._enter_policy(state, None)
            return
        if self.requests.get(request.request_id, state) is not state:
            state.emit(ErrorEvent(InvalidRequestError(
                f"sequence {request.request_id} is already waiting or running")))
            return
        self.requests[request.request_id] = state
        admission = flow.route(request)
        if admission is not None:  # None: parked behind a leader's shared prefix
            self._enter_policy(state, admission)

    def _hold_follower(self, state: RequestState) -> bool:
        """Keep a later choice of an ``n > 1`` request until its leader has the prompt."""
        leader = self.requests.get(state.request.fork_of or "")
        prompt = None if leader is None else tuple(leader.request.prompt_tokens)
        if leader is None or not self.forks.hold(state, prompt):
            return False
        self.requests[state.request.request_id] = state
        if leader.num_generated or leader.saw_eog:  # the prompt is already computed
            self._release_followers(leader.request.request_id)
        return True

    def _release_followers(self, leader_id: str) -> None:
        for state, admission in self.forks.release(leader_id):
            self._enter_policy(state, admission)

    def _leave_forks(self, req_id: str) -> None:
        """A request left: forget it as a follower; as a leader, free its followers."""
        self.forks.forget(req_id)
        for state in self.forks.abandon(req_id):
            self._route(state)

    def _enter_policy(self, state: RequestState, admission: Admission | None) -> bool:
        """Submit to the policy; on refusal answer with an ``ErrorEvent`` and forget it."""
        request = state.request
        error: WorkerError | None = None
        try:
            self.scheduler.submit(self._make_sequence(request, admission))
        except PolicyQueueFullError:
            error = QueueFullError()
        except PolicyInputError as exc:  # duplicate id, empty prompt, bad field
            error = InvalidRequestError(str(exc))
        if error is None:
            self.requests[request.request_id] = state
            return True
        if self.requests.get(request.request_id) is state:
            del self.requests[request.request_id]
            if self.prefix_flow is not None:
                self.prefix_flow.forget(request.request_id)
        state.emit(ErrorEvent(error))
        return False

    def _reroute(self, released: Iterable[GenerationRequest]) -> None:
        """Route requests released from parking again (they may hit, or park anew)."""
        flow = self.prefix_flow
        for request in released if flow is not None else ():
            state = self.requests.get(request.request_id)
            if state is None:
                continue
            admission = flow.route(request)
            if admission is not None:
                self._enter_policy(state, admission)

    def _make_sequence(self, request: GenerationRequest,
                       admission: Admission | None = None) -> Sequence:
        # Reserve bounded decode headroom, not the client's whole ceiling.
        reserve = admission_tokens(len(request.prompt_tokens), request.max_tokens,
                                   self._kv_capacity)
        sampling = request.sampling
        if sampling is not None and sampling.grammar is not None:
            # The grammar constrains what follows the prompt (replayed after a preemption).
            sampling = dataclasses.replace(sampling, grammar_start=len(request.prompt_tokens))
        sequence = Sequence(
            id=request.request_id,
            prompt_tokens=request.prompt_tokens,
            max_tokens=request.max_tokens,
            sampling=sampling,
            priority=request.priority,
        ).with_admission_tokens(reserve)
        if request.generated_tokens:
            sequence.with_prefilled_generation(request.generated_tokens)
        if admission is not None:
            sequence.with_cache_affinity(admission.affinity)
            if admission.restore is not None:
                sequence.with_prefix_restore(admission.restore)
        return sequence

    def cancel(self, req_id: str) -> None:
        """Forget a request without an event; idempotent."""
        self.scheduler.cancel(req_id)
        state = self.requests.pop(req_id, None)
        if state is not None and not state.request.retain_runtime:
            self.drop_runtime_sessions([req_id])
        self._leave_prefix_cache(req_id)
        self._leave_forks(req_id)

    def _leave_prefix_cache(self, req_id: str) -> None:
        """Release the request's lease and whatever was parked behind it."""
        if self.prefix_flow is not None:
            self.prefix_flow.forget(req_id)
            self._reroute(self.prefix_flow.release_followers(req_id))

    def fail_request(self, req_id: str, error: WorkerError) -> None:
        """Cancel a request and send it ``error``."""
        state = self.requests.get(req_id)
        self.cancel(req_id)
        if state is not None:
            state.emit(ErrorEvent(error))

    def fail_all(self, error: WorkerError) -> None:
        """Fail every held generation with ``error``."""
        for req_id in list(self.requests):
            self.fail_request(req_id, error)

    def drop_runtime_sessions(self, req_ids: Iterable[str]) -> None:
        """Drop runtime sessions; a failing drop is logged, never raised."""
        for req_id in req_ids:
            try:
                self.runtime.drop_session(req_id)
            except RuntimeFailure as exc:
                logger.warning("dropping runtime session %s failed: %s", req_id, exc)
        self._on_sessions_dropped()

    def _release_preempted(self, req_id: str) -> None:
        """Free a preempted request's KV; it replays from the start when re-admitted."""
        state = self.requests.get(req_id)
        if state is None:
            return
        if not state.request.retain_runtime:
            state.runtime_configured = False
            self.drop_runtime_sessions([req_id])
            return
        try:  # the caller owns this session: empty it, keep it
            self.runtime.trim_session(req_id, 0)
        except RuntimeFailure as exc:
            logger.warning("trimming preempted session %s failed: %s", req_id, exc)

    # -- token acknowledgements -----------------------------------------------------------

    def apply_pending_controls(self) -> None:
        """Apply answered acks without waiting for unanswered ones."""
        stopped = [req_id for req_id, state in self.requests.items() if consumer_stopped(state)]
        for req_id in stopped:
            self._complete(req_id)

    def _complete(self, req_id: str) -> None:
        """End a request normally: leave the policy, free its session, send Complete."""
        self.scheduler.finish(req_id)
        state = self.requests.pop(req_id, None)
        if state is None:
            return
        if self.prefix_flow is not None:
            self.prefix_flow.record_finished(req_id)
        if not state.request.retain_runtime:
            self.drop_runtime_sessions([req_id])
        state.emit(CompleteEvent(state.finish_reason()))
        self._leave_prefix_cache(req_id)
        self._leave_forks(req_id)

    # -- one planned turn --------------------------------------------------------------

    def run_iteration(self) -> bool:
        """Plan and run one iteration; False when the policy had nothing to run.

        Precondition: the caller decided to serve planned work this turn (planning
        advances cursors, so it must only happen when the plan will run).
        """
        started = time.monotonic()
        plan = self.scheduler.plan_iteration()
        if plan.is_empty():
            return False
        plan = self._prepare_sessions(plan)
        if plan.is_empty():
            return True
        try:
            result = self._executor.execute(plan)
        except RuntimeFailure as exc:
            self._fail_everything(worker_error_from_runtime("scheduler iteration", exc))
            return True
        if result is None:
            return True
        if not result.isolated:
            # NOTE: works re-run one by one take the sum of their times: fed to the
            # calibration, one bad token id would switch mixed batches off for good.
            self.scheduler.observe_iteration_duration(result.plan, result.execution_s)
        step = self.scheduler.complete_iteration(result.plan, result.predictions())
        self._finish_iteration(result)
        if self.prefix_flow is not None:
            self._reroute(self.prefix_flow.release_ready())
        self._emit_step_telemetry(step, time.monotonic() - started, result.execution_s)
        return True

    def _prepare_sessions(self, plan: IterationPlan) -> IterationPlan:
        """Bind a runtime session to every newly planned request."""
        dropped: list[str] = []
        for work in plan.work:
            state = self.requests.get(work.sequence_id)
            if state is None:
                dropped.append(work.sequence_id)
                continue
            if state.runtime_configured:
                continue
            try:
                if self.prefix_flow is not None:
                    self.prefix_flow.bind(work.sequence_id,
                                          self.scheduler.config.prefill_chunk_tokens)
                else:
                    self.runtime.ensure_session_active(work.sequence_id)
                self.forks.restore(work.sequence_id)
            except RuntimeFailure as exc:
                error = worker_error_from_runtime(
                    f"prepare scheduler session {work.sequence_id}", exc
                )
                self.fail_request(work.sequence_id, error)
                dropped.append(work.sequence_id)
                continue
            state.runtime_configured = True
        return plan.without_sequences(dropped) if dropped else plan

    def _finish_iteration(self, result: PlanResult) -> None:
        """Send token events, fail unanswered rows, complete terminal requests."""
        missing: list[str] = []
        stopped: list[str] = []
        for index, work in enumerate(result.plan.work):
            state = self.requests.get(work.sequence_id)
            if state is None:
                continue
            if index in result.prompt_logprobs:
                state.emit(PromptLogprobsEvent(tuple(result.prompt_logprobs[index])))
            if not work.sample_last:
                continue
            sample = result.samples.get(index)
            if sample is None:
                missing.append(work.sequence_id)
                continue
            self._release_followers(work.sequence_id)
            if sample.is_eog:
                state.saw_eog = True  # end of generation: no token event
            else:
                state.num_generated += 1
                ack = TokenAck()
                state.pending_controls.append(ack.slot)  # never the ack: see TokenAck
                if not state.emit(TokenEvent(sample.token, ack, sample.logprob)):
                    stopped.append(work.sequence_id)
        for req_id in missing:
            self.fail_request(req_id, WorkerBackendError(
                f"scheduler iteration returned no prediction for {req_id}"
            ))
        for req_id in stopped:
            self.scheduler.cancel(req_id)
        for req_id in {work.sequence_id for work in result.plan.work}:
            if req_id in self.requests and req_id not in self.scheduler:
                self._complete(req_id)

    def _emit_step_telemetry(
        self, step: IterationTelemetry, total_s: float, execution_s: float
    ) -> None:
        """Publish ``stage.scheduler_iteration``."""
        self.last_step_ms = total_s * 1000.0
        self.last_execution_ms = execution_s * 1000.0
        prefix = "skippy.scheduler."
        attributes = step_attributes(step, self.last_step_ms, self.last_execution_ms)
        lifecycle = (step.finished, step.failed, step.cancelled, step.rejected_overload)
        if lifecycle != self._last_lifecycle:
            # Counters only when they changed since the last emission.
            self._last_lifecycle = lifecycle
            for name, value in zip(("finished", "failed", "cancelled", "rejected_overload"),
                                   lifecycle, strict=True):
                attributes[prefix + name] = value
        self._publish(SCHEDULER_ITERATION, attributes)

