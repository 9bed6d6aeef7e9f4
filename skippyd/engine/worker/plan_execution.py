"""Running one policy plan as one batched runtime call.

Besides the happy path this module owns the two recoveries a plan needs:

* ``KvSlotUnavailableError`` is back-pressure, not a failure: the batch did not apply, so
  KV that idle lanes keep for the prefix cache is given back first (in a shared pool
  it takes cells running sessions need), then a victim chosen by the policy's
  preemption rule (the latest admitted) gives its KV back, and the rest of the plan is
  retried; the victim recomputes when it is admitted again. (With a KV stream per lane
  a session can only run out of its own lane, which the HTTP layer's context check
  prevents.)
* ``InvalidIterationError`` names one bad request (a token outside the vocabulary, say);
  rather than failing every generation in the batch, the works are re-run one by one so
  only the bad one fails.

The executor calls nobody back: what it preempted and which requests it could not run
come back in :class:`Execution`, for the worker to apply to its records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from skippyd.engine.policy import (
    IterationPhase,
    IterationPlan,
    IterationPrediction,
    IterationWork,
    Scheduler,
)
from skippyd.engine.runtime.contract import (
    InvalidIterationError,
    IterationOutput,
    IterationRequest,
    IterationSample,
    KvSlotUnavailableError,
    RowPhase,
    Runtime,
    RuntimeFailure,
    TokenLogprob,
)
from skippyd.engine.worker.faults import FaultSwitch
from skippyd.engine.worker.worker_errors import (
    InvalidRequestError,
    RuntimeCapacityError,
    WorkerError,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PlanSample:
    """A token sampled for one work."""

    token: int
    is_eog: bool
    logprob: TokenLogprob | None = None
    followers: tuple[PlanSample, ...] = ()
    """Tokens sampled after it at the rows of the drafts it confirmed (see
    :attr:`~skippyd.engine.runtime.contract.IterationSample.followers`)."""
    drafted: int = 0
    """Drafts the row verified; ``len(followers)`` were accepted."""

    @property
    def tokens(self) -> tuple[PlanSample, ...]:
        """This sample and its followers, in order."""
        return (self, *self.followers)

    @classmethod
    def from_runtime(cls, sample: IterationSample) -> PlanSample:
        return cls(sample.token, sample.is_eog, sample.logprob,
                   tuple(cls(f.token, f.is_eog, f.logprob) for f in sample.followers),
                   sample.drafted)


@dataclass(slots=True)
class PlanResult:
    """What an executed plan produced."""

    plan: IterationPlan
    """The plan that actually ran (works of preempted or failed requests removed)."""
    samples: dict[int, PlanSample]
    """Samples by work index; a row sampled twice is left out (treated as missing)."""
    execution_s: float
    """Wall time of the runtime call(s)."""
    prompt_logprobs: dict[int, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)
    """Prompt-token log-probabilities by work index (requests that asked for them)."""
    isolated: bool = False
    """The works ran one by one (after an invalid batch): not one batch's duration."""

    def predictions(self) -> list[IterationPrediction]:
        """Policy predictions; end of generation is a negative token."""
        predictions = []
        for index, sample in self.samples.items():
            first, *more = [-1 if s.is_eog else s.token for s in sample.tokens]
            predictions.append(IterationPrediction(index, first, tuple(more)))
        return predictions


def make_runtime_request(work: IterationWork) -> IterationRequest:
    """Map a policy work to a runtime request (Recompute runs as a prefill)."""
    phase = RowPhase.DECODE if work.phase is IterationPhase.DECODE else RowPhase.PREFILL
    # NOTE: explicit positions, not "after what the session holds": after a preemption
    # the replay restarts at 0 and the runtime must trim to it.
    return IterationRequest(
        session_id=work.sequence_id,
        token_ids=work.tokens,
        positions=work.positions,
        sampling=work.sampling,  # type: ignore[arg-type]
        sample_last=work.sample_last,
        phase=phase,
        draft=work.draft,
    )


def index_samples(output: IterationOutput, num_works: int) -> dict[int, PlanSample]:
    """Samples by request index; out-of-range indices are ignored, duplicates dropped."""
    samples: dict[int, PlanSample] = {}
    duplicates: set[int] = set()
    for sample in output.samples:
        index = sample.request_index
        if not 0 <= index < num_works:
            continue
        if index in samples:
            duplicates.add(index)
        samples[index] = PlanSample.from_runtime(sample)
    for index in duplicates:
        del samples[index]
    return samples


@dataclass(slots=True)
class Execution:
    """What running a plan did, for the worker to apply."""

    result: PlanResult | None = None
    """What ran and what it sampled; None when nothing ran."""
    preempted: list[str] = field(default_factory=list)
    """Requests preempted (their KV already freed) to make room; they recompute later."""
    failed: list[tuple[str, WorkerError]] = field(default_factory=list)
    """Requests that cannot run, with the error each must end with."""


class PlanExecutor:
    """Runs plans on the runtime; worker thread only.

    Args:
        runtime: The runtime.
        scheduler: The policy scheduler (for preemption under KV pressure).
        faults: The test fault switch (point ``execute``).
        before_model_call: Runs right before each runtime call (the worker's wait hooks).
    """

    def __init__(
        self,
        runtime: Runtime,
        scheduler: Scheduler,
        faults: FaultSwitch,
        before_model_call: Callable[[], None] = lambda: None,
        reclaim_kept_kv: Callable[[], int] = lambda: 0,
    ) -> None:
        self._runtime = runtime
        self._scheduler = scheduler
        self._faults = faults
        self._before_model_call = before_model_call
        self._reclaim_kept_kv = reclaim_kept_kv

    def execute(self, plan: IterationPlan) -> Execution:
        """Run ``plan``. Fatal runtime failures propagate.

        Raises:
            RuntimeFailure: The runtime failed for a reason no retry can fix.
        """
        execution = Execution()
        while not plan.is_empty():
            try:
                execution.result = self._run(plan)
                return execution
            except KvSlotUnavailableError as exc:
                plan = self._relieve_kv_pressure(plan, exc, execution)
            except InvalidIterationError as exc:
                if len(plan.work) > 1:
                    execution.result = self._run_isolated(plan, execution)
                    return execution
                execution.failed.append((plan.work[0].sequence_id,
                                         InvalidRequestError(f"scheduler iteration: {exc}")))
                return execution
        return execution

    def _run(self, plan: IterationPlan) -> PlanResult:
        requests = [make_runtime_request(work) for work in plan.work]
        self._faults.reach("execute")
        self._before_model_call()
        started = time.monotonic()
        output = self._runtime.run_iteration(requests)
        elapsed = time.monotonic() - started
        return PlanResult(plan, index_samples(output, len(requests)), elapsed,
                          dict(output.prompt_logprobs))

    def _relieve_kv_pressure(self, plan: IterationPlan, exc: KvSlotUnavailableError,
                             execution: Execution) -> IterationPlan:
        """Free cells and return the plan left to retry (maybe empty).

        Drafts go first (they are optional work), then, in a shared pool, KV that idle
        lanes keep for the prefix cache, one lane at a time; then one running sequence is
        preempted by the policy's rule.
        """
        if plan.num_drafted:
            logger.debug("KV slot unavailable (%s): retrying without drafts", exc)
            return plan.without_drafts()
        freed = self._reclaim_kept_kv()
        if freed:
            logger.debug("KV slot unavailable (%s): freed %d kept cells", exc, freed)
            return plan
        victim = self._preempt_one()
        if victim is None:
            # Only one sequence holds KV and it still does not fit: retrying it later
            # would spin forever, so it fails with a retryable capacity error.
            for req_id in {work.sequence_id for work in plan.work}:
                execution.failed.append((req_id, RuntimeCapacityError(
                    f"no KV cache room for request {req_id}: {exc}")))
            return IterationPlan()
        logger.info("KV slot unavailable (%s): preempted %s", exc, victim)
        try:  # its KV: it replays from the start when admitted again
            self._runtime.drop_session(victim)
        except RuntimeFailure as drop_exc:
            logger.warning("dropping the session of preempted %s failed: %s", victim, drop_exc)
        execution.preempted.append(victim)
        return plan.without_sequences([victim])

    def _preempt_one(self) -> str | None:
        """Preempt exactly one sequence by the policy's victim rule; None if at most one."""
        if len(self._scheduler.snapshot().active_ids) <= 1:
            return None
        return self._scheduler.preempt_one()

    def _run_isolated(self, plan: IterationPlan, execution: Execution) -> PlanResult:
        """Run each work alone so one malformed request cannot fail the batch."""
        samples: dict[int, PlanSample] = {}
        prompt_logprobs: dict[int, list[tuple[int, TokenLogprob]]] = {}
        execution_s = 0.0
        for index, work in enumerate(plan.work):
            single = IterationPlan(work=[work], token_count=work.token_count)
            try:
                result = self._run(single)
            except InvalidIterationError as exc:
                execution.failed.append((work.sequence_id,
                                         InvalidRequestError(f"scheduler iteration: {exc}")))
                continue
            except KvSlotUnavailableError as exc:
                execution.failed.append((work.sequence_id, RuntimeCapacityError(
                    f"no KV cache room for request {work.sequence_id}: {exc}")))
                continue
            execution_s += result.execution_s
            if 0 in result.samples:
                samples[index] = result.samples[0]
            if 0 in result.prompt_logprobs:
                prompt_logprobs[index] = result.prompt_logprobs[0]
        return PlanResult(plan, samples, execution_s, prompt_logprobs, isolated=True)
