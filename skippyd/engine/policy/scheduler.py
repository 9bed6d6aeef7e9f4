"""The iteration scheduler policy; ``docs/scheduler.md`` ("The policy") explains it.

Each turn the driver calls :meth:`Scheduler.plan_iteration`, runs the plan's rows in one
native batch, then reports what was sampled with :meth:`Scheduler.complete_iteration`.
Every sequence only moves its prefill cursor towards its replay length and then decodes
one token at a time, so chunked prefill, prefix restore and recompute after preemption
share one code path. The scheduler is single-threaded and does no I/O: the driver owns
time, threads and the runtime.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

from skippyd.engine.policy.cache_order import CacheAwareCandidate, order_cache_aware_candidates
from skippyd.engine.policy.calibration import MixedCalibration
from skippyd.engine.policy.completion import apply_prediction, index_predictions
from skippyd.engine.policy.config import SchedulerConfig
from skippyd.engine.policy.counters import (
    IterationTelemetry,
    SchedulerMetrics,
    SchedulerSnapshot,
    SequenceProgress,
)
from skippyd.engine.policy.input_errors import (
    DuplicateSequenceError,
    EmptyPromptError,
    PolicyInputError,
    WaitingQueueFullError,
)
from skippyd.engine.policy.memory import MemoryLedger
from skippyd.engine.policy.plan import IterationPhase, IterationPlan, IterationPrediction
from skippyd.engine.policy.planning import (
    check_plan_invariants,
    live_decode_rows,
    plan_budgeted,
    plan_mixed,
    plan_phase_homogeneous,
    prompt_order,
)
from skippyd.engine.policy.sequence import ScheduledSequence, SequenceStatus
from skippyd.engine.policy.step_budget import MIN_PREFILL_TOKENS, StepCostModel, TargetStretch

logger = logging.getLogger(__name__)


class Scheduler:
    """Admits, plans, completes and preempts sequences; pure policy.

    Each turn, ``plan_iteration`` admits what fits and assigns every admitted sequence
    either its next prompt chunk or its one pending decode token, within one token budget;
    ``complete_iteration`` then appends what the runtime sampled and retires finished
    sequences. Memory is reserved per sequence on admission and given back when it ends
    or is preempted for recompute.

    Args:
        config: Settings; normalised on construction.
        clock: Returns "now" in seconds for ``ScheduledSequence.admitted_at``; defaults to
            ``time.monotonic``. A simulation passes its virtual clock.
    """

    def __init__(
        self, config: SchedulerConfig | None = None, clock: Callable[[], float] | None = None
    ) -> None:
        if config is not None and not isinstance(config, SchedulerConfig):
            raise PolicyInputError(f"Scheduler needs a SchedulerConfig, got "
                                   f"{type(config).__name__}")
        self._config = (config or SchedulerConfig()).normalized()
        self._clock = clock or time.monotonic
        self._active: dict[str, ScheduledSequence] = {}
        self._waiting: list[ScheduledSequence] = []
        self._memory = MemoryLedger(self._config.memory_components)
        self._metrics = SchedulerMetrics()
        self._calibration = MixedCalibration()
        self._costs = StepCostModel()
        self._stretch = TargetStretch()
        self._target_us = self._config.target_step_us
        """The step target of the last plan, before its stretch."""
        self._waiting_turn = 0
        self._next_waiting_order = 0
        self._next_admission_serial = 0
        self._waiting_order_dirty = False
        self._consecutive_prefill_iterations = 0
        self._mixed_decode_cursor = 0

    @property
    def config(self) -> SchedulerConfig:
        """The normalised configuration in force."""
        return self._config

    # -- admission -------------------------------------------------------------------------

    def submit(self, sequence: ScheduledSequence) -> None:
        """Queue a sequence for admission.

        The scheduler keeps and changes ``sequence`` itself from now on: the caller may
        read it (its cursor, its generated tokens) but must not change it. Memory is not
        checked here: a sequence that does not fit yet waits.

        Raises:
            EmptyPromptError: The prompt has no token.
            DuplicateSequenceError: The id is already waiting or active.
            WaitingQueueFullError: The waiting queue is full (counted as ``rejected_overload``).
            PolicyInputError: ``sequence`` is not a :class:`ScheduledSequence`.
        """
        if not isinstance(sequence, ScheduledSequence):
            raise PolicyInputError(f"submit needs a ScheduledSequence, got {type(sequence).__name__}")
        if not sequence.prompt_tokens:
            raise EmptyPromptError()
        if sequence.id in self._active or any(w.id == sequence.id for w in self._waiting):
            raise DuplicateSequenceError(sequence.id)
        if len(self._waiting) >= self._config.max_waiting_sequences:
            self._metrics.rejected_overload += 1
            raise WaitingQueueFullError(self._config.max_waiting_sequences)
        if sequence.prefix_restore is not None:
            self._metrics.prefix_hits += 1
        else:
            self._metrics.prefix_misses += 1
        sequence.status = SequenceStatus.WAITING
        sequence.enqueued_turn = self._waiting_turn
        sequence.enqueue_order = self._take_waiting_order()
        self._waiting.append(sequence)
        self._waiting_order_dirty = True
        self._refresh_gauges()

    def _take_waiting_order(self) -> int:
        order = self._next_waiting_order
        self._next_waiting_order += 1
        return order

    def _admit_waiting(self) -> tuple[str, ...]:
        """Admit every waiting sequence that fits, best first, without head-of-line blocking.

        The queue is re-sorted only when it changed (submit, cancel, preemption), not
        every turn although ages grow: a drained queue's order stays stable, so a
        prefix group stays adjacent.
        """
        if self._waiting_order_dirty:
            self._sort_waiting()
        admitted: list[str] = []
        deferred: list[ScheduledSequence] = []
        for sequence in self._waiting:
            if len(self._active) >= self._config.max_active_sequences or not (
                self._memory.can_reserve(_reserved(sequence))
            ):
                deferred.append(sequence)  # keep scanning: a smaller one may still fit
                continue
            self._memory.reserve(_reserved(sequence))
            sequence.status = SequenceStatus.RUNNING
            sequence.admitted_at = self._clock()
            sequence.admission_serial = self._next_admission_serial
            self._next_admission_serial += 1
            self._active[sequence.id] = sequence
            admitted.append(sequence.id)
        self._waiting = deferred
        return tuple(admitted)

    def _sort_waiting(self) -> None:
        candidates = [
            CacheAwareCandidate(
                index=index,
                affinity=sequence.cache_affinity,
                prompt_tokens=sequence.prompt_tokens,
                enqueued_turn=sequence.enqueued_turn,
                order=sequence.enqueue_order,
            )
            for index, sequence in enumerate(self._waiting)
        ]
        order = order_cache_aware_candidates(
            candidates,
            self._waiting_turn,
            self._config.cache_aging_cost_per_iteration,
            self._config.group_waiting_prefixes,
        )
        if sorted(order) == list(range(len(self._waiting))):
            self._waiting = [self._waiting[index] for index in order]
        self._waiting_order_dirty = False

    # -- planning --------------------------------------------------------------------------

    def plan_iteration(self) -> IterationPlan:
        """Admit what fits and plan the next iteration's works.

        Returns:
            A fresh plan; empty when there is nothing to run.
        """
        self._waiting_turn += 1
        admitted = self._admit_waiting()
        sequences = [self._active[sequence_id] for sequence_id in sorted(self._active)]
        rows = live_decode_rows(sequences, self._config)
        if self._config.mixed_prefill_decode and self._config.target_step_us > 0:
            target = self._costs.step_target_us(rows, self._config.target_step_us,
                                                self._config.target_decode_steps)
            self._target_us = target
            most = self._config.max_tokens_per_iteration - rows
            budget = self._costs.prefill_budget(rows, target, most)
            # When prompts queue up the target stretches (see ``step_budget``).
            remaining = [sequence.replay_remaining()
                         for sequence in sequences if sequence.needs_replay()]
            long_prompts = sum(1 for tokens in remaining if tokens > budget)
            stretch = self._stretch.factor(long_prompts, len(remaining) - long_prompts)
            if stretch > 1:
                budget = self._costs.prefill_budget(rows, target * stretch, most)
            by_admission = sorted(sequences, key=lambda s: s.admission_serial)
            order = prompt_order(by_admission, budget, MIN_PREFILL_TOKENS if rows else 0,
                                 self._config.max_prefill_sequences_per_iteration)
            oldest = next((s.id for s in by_admission if s.needs_replay()), None)
            work, self._mixed_decode_cursor = plan_budgeted(
                sequences, order, self._config, budget, self._mixed_decode_cursor, oldest)
            self._consecutive_prefill_iterations = 0
        elif self._config.mixed_prefill_decode and self._calibration.allows_mixed(rows):
            work, self._mixed_decode_cursor = plan_mixed(
                sequences, self._config, self._mixed_decode_cursor
            )
            self._consecutive_prefill_iterations = 0
        else:
            work, self._consecutive_prefill_iterations = plan_phase_homogeneous(
                sequences, self._config, self._consecutive_prefill_iterations
            )
        plan = IterationPlan(
            work=work, token_count=sum(w.token_count for w in work), admitted_ids=admitted
        )
        check_plan_invariants(plan, self._config, self._active, self._waiting)
        return plan

    def observe_iteration_duration(self, plan: IterationPlan, elapsed_s: float) -> None:
        """Feed back how long ``plan`` took, for the mixed-mode calibration and the
        step-time budget's costs."""
        self._calibration.observe(plan, elapsed_s)
        self._costs.observe(plan, elapsed_s)

    @property
    def step_target_us(self) -> int:
        """The step time the last plan sized its prompt chunks for (µs): the target (at
        least ``target_decode_steps`` decode steps), stretched while prompts queue up
        (``TargetStretch``); 0 without a target."""
        if not (self._config.mixed_prefill_decode and self._config.target_step_us > 0):
            return 0
        return self._target_us * self._stretch.current

    @property
    def step_costs(self) -> StepCostModel:
        """The learned step costs the step-time budget plans with (read-only use)."""
        return self._costs

    @property
    def mixed_prefill_viable(self) -> bool:
        """False once a mixed iteration proved too slow; it never comes back."""
        return self._calibration.mixed_prefill_viable

    # -- completion -----------------------------------------------------------------------

    def complete_iteration(
        self, plan: IterationPlan, predictions: Iterable[IterationPrediction] = ()
    ) -> IterationTelemetry:
        """Apply the tokens sampled for ``plan`` and retire finished sequences.

        A sampling row without a (unique) prediction fails its sequence, a negative token
        ends it; rows of sequences cancelled while the plan ran are skipped
        (``docs/scheduler.md``, *Completion*).

        Args:
            plan: A plan returned by :meth:`plan_iteration` (possibly with works dropped).
            predictions: Sparse ``(work_index, token)`` records; indices out of range are
                ignored and an index given twice counts as missing.

        Returns:
            What this iteration did.

        Raises:
            PolicyInputError: ``plan`` or a prediction has the wrong type (nothing changes).
        """
        predicted = index_predictions(plan, predictions)
        tokens = {phase: 0 for phase in IterationPhase}
        finished: list[str] = []
        failed: list[str] = []
        for index, work in enumerate(plan.work):
            tokens[work.phase] += work.token_count
            sequence = self._active.get(work.sequence_id)
            if not work.sample_last or sequence is None or sequence.status.is_finished():
                continue
            apply_prediction(sequence, predicted.get(index), finished, failed)
        for sequence_id in finished + failed:
            self._release_active(sequence_id)
        return self._record_iteration(plan, tokens, finished, failed)

    def _record_iteration(
        self,
        plan: IterationPlan,
        tokens: dict[IterationPhase, int],
        finished: list[str],
        failed: list[str],
    ) -> IterationTelemetry:
        metrics = self._metrics
        metrics.finished += len(finished)
        metrics.failed += len(failed)
        metrics.iterations += 1
        metrics.admitted += plan.admitted
        metrics.prefill_tokens += tokens[IterationPhase.PREFILL]
        metrics.recompute_tokens += tokens[IterationPhase.RECOMPUTE]
        metrics.decode_tokens += tokens[IterationPhase.DECODE]
        self._refresh_gauges()
        return IterationTelemetry(
            iteration=metrics.iterations,
            active_sequences=metrics.active_sequences,
            waiting_sequences=metrics.waiting_sequences,
            admitted=plan.admitted,
            preempted=plan.preempted,
            prefill_tokens=tokens[IterationPhase.PREFILL],
            recompute_tokens=tokens[IterationPhase.RECOMPUTE],
            decode_tokens=tokens[IterationPhase.DECODE],
            component_used=self._memory.used(),
            component_available=self._memory.available(),
            prefix_hits=metrics.prefix_hits,
            prefix_misses=metrics.prefix_misses,
            finished=metrics.finished,
            failed=metrics.failed,
            cancelled=metrics.cancelled,
            rejected_overload=metrics.rejected_overload,
            finished_ids=tuple(finished),
            failed_ids=tuple(failed),
        )

    # -- preemption, cancellation, inspection ----------------------------------------------

    def preempt_for_component_pressure(self, component_used: Iterable[int]) -> list[str]:
        """Adopt observed memory use, then preempt until every component fits.

        The victim is the most recently admitted active sequence. It goes back to the
        front of the queue for recompute and keeps its ``enqueued_turn``, so its aging
        credit survives.

        Args:
            component_used: Observed used bytes per memory component, in config
                order; extra or missing entries are ignored.

        Returns:
            Ids of the preempted sequences, in preemption order.
        """
        self._memory.overwrite(component_used)
        victims: list[str] = []
        while self._memory.over_capacity() and self._active:
            victims.append(self._preempt_next_victim())
        if victims:
            logger.info("preempted %d sequence(s) under memory pressure: %s",
                        len(victims), victims)
        self._refresh_gauges()
        return victims

    def preempt_one(self) -> str | None:
        """Preempt the next victim by the same rule, whatever the memory accounting says.

        For a driver whose runtime reported back-pressure (no free KV slot) that the
        component accounting did not foresee.

        Returns:
            The preempted id, or None when nothing is active.
        """
        if not self._active:
            return None
        victim = self._preempt_next_victim()
        logger.info("preempted %s on runtime back-pressure", victim)
        self._refresh_gauges()
        return victim

    def _preempt_next_victim(self) -> str:
        victim = min(self._active.values(), key=self._victim_key)
        self._release_active(victim.id)
        victim.reset_for_recompute()
        victim.enqueue_order = self._take_waiting_order()
        self._waiting.insert(0, victim)
        self._waiting_order_dirty = True
        self._metrics.preempted += 1
        return victim.id

    @staticmethod
    def _victim_key(sequence: ScheduledSequence) -> tuple[float, int]:
        # The latest admission (no timestamp counts as now).
        admitted_at = sequence.admitted_at if sequence.admitted_at is not None else float("inf")
        return (-admitted_at, -sequence.admission_serial)

    def _release_active(self, sequence_id: str) -> ScheduledSequence:
        sequence = self._active.pop(sequence_id)
        self._memory.release(_reserved(sequence))
        return sequence

    def cancel(self, sequence_id: str) -> bool:
        """Remove a waiting or active sequence and free its memory; idempotent.

        A sequence its consumer ended (a stop string, a client that left) is cancelled
        too: only the policy's own retirements count as finished.

        Returns:
            True if the sequence existed.
        """
        if not self._remove(sequence_id):
            return False
        self._metrics.cancelled += 1
        self._refresh_gauges()
        return True

    def _remove(self, sequence_id: str) -> bool:
        if sequence_id in self._active:
            self._release_active(sequence_id)
            return True
        index = next((i for i, w in enumerate(self._waiting) if w.id == sequence_id), None)
        if index is None:
            return False
        del self._waiting[index]
        self._waiting_order_dirty = True
        return True

    def sequence(self, sequence_id: str) -> ScheduledSequence | None:
        """A copy of an active (else waiting) sequence; None once it is gone."""
        found = self._active.get(sequence_id)
        if found is None:
            found = next((w for w in self._waiting if w.id == sequence_id), None)
        return found.clone() if found is not None else None

    def __contains__(self, sequence_id: object) -> bool:
        """True while the sequence is waiting or active (cheap existence check)."""
        return sequence_id in self._active or any(w.id == sequence_id for w in self._waiting)

    @property
    def num_active(self) -> int:
        """Admitted sequences, prefilling or decoding."""
        return len(self._active)

    def snapshot(self) -> SchedulerSnapshot:
        """Ids of active (sorted) and waiting (queue order) sequences, and memory use."""
        return SchedulerSnapshot(
            active_ids=tuple(sorted(self._active)),
            waiting_ids=tuple(sequence.id for sequence in self._waiting),
            component_used=self._memory.used(),
        )

    def progress(self) -> tuple[SequenceProgress, ...]:
        """How far each active sequence has come, in id order.

        Cheaper than :meth:`sequence` for every id (nothing is copied): a status view
        reads it every few steps while the worker is busy.
        """
        return tuple(
            SequenceProgress(sequence_id, len(sequence.prompt_tokens),
                             len(sequence.generated_tokens), sequence.needs_replay())
            for sequence_id, sequence in sorted(self._active.items())
        )

    def metrics(self) -> SchedulerMetrics:
        """A copy of the cumulative counters and current gauges."""
        self._refresh_gauges()
        return dataclasses.replace(self._metrics)

    def _refresh_gauges(self) -> None:
        self._metrics.active_sequences = len(self._active)
        self._metrics.waiting_sequences = len(self._waiting)


def _reserved(sequence: ScheduledSequence) -> int:
    """The tokens a sequence reserves while admitted (set by the time it is submitted)."""
    tokens = sequence.admission_tokens
    assert tokens is not None, "ScheduledSequence.__post_init__ sets admission_tokens"
    return tokens
