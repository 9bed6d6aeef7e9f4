"""Property tests over random workloads: the scheduler's invariants hold whatever happens."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from skippyd.engine.policy import (
    UNLIMITED,
    AdmissionError,
    CacheAffinity,
    IterationPhase,
    IterationPrediction,
    MemoryComponent,
    PrefixRestore,
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
    StageCacheAffinity,
)

MAX_PROMPT, MAX_OUTPUT = 24, 6
KV_CAPACITY = st.integers(MAX_PROMPT + MAX_OUTPUT, 200)

configs = st.fixed_dictionaries({
    "max_active_sequences": st.integers(1, 6),
    "max_waiting_sequences": st.integers(1, 12),
    "max_tokens_per_iteration": st.integers(1, 48),
    "prefill_chunk_tokens": st.integers(1, 32),
    "max_prefill_sequences_per_iteration": st.sampled_from([1, 2, UNLIMITED]),
    "max_consecutive_prefill_iterations": st.sampled_from([1, 2, UNLIMITED]),
    "mixed_prefill_decode": st.booleans(),
    "cache_aging_cost_per_iteration": st.integers(1, 100),
    "group_waiting_prefixes": st.booleans(),
    "target_step_us": st.just(0),
})

submit_ops = st.tuples(
    st.just("submit"),
    st.lists(st.integers(0, 3), min_size=1, max_size=MAX_PROMPT),  # few token values: shared runs
    st.integers(1, MAX_OUTPUT),
    st.integers(0, MAX_PROMPT),  # restored prefix (0 = none)
    st.integers(0, 40),  # matched tokens for the cache affinity
)
step_ops = st.tuples(st.just("step"), st.integers(0, 7), st.sampled_from([0, 0, 900, 4000, 30_000]))
cancel_ops = st.tuples(st.just("cancel"), st.integers(0, 50))
preempt_ops = st.tuples(st.just("preempt"), st.integers(0, 200))
operations = st.lists(
    st.one_of(submit_ops, submit_ops, step_ops, step_ops, step_ops, cancel_ops, preempt_ops,
              preempt_ops),
    min_size=8, max_size=60,
)


@dataclass
class Run:
    """Everything a run produced, for the determinism comparison."""

    plans: list[tuple] = field(default_factory=list)
    live: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)


def _make(config: dict, kv_capacity: int) -> Scheduler:
    ticks = itertools.count()
    memory = [MemoryComponent("kv", kv_capacity, per_token=1)]
    return Scheduler(SchedulerConfig(memory_components=memory, **config),
                     clock=lambda: float(next(ticks)))


def _reserved(scheduler: Scheduler) -> int:
    return sum(scheduler.sequence(i).admission_tokens for i in scheduler.snapshot().active_ids)


def _check_state(scheduler: Scheduler, kv_capacity: int) -> None:
    snapshot = scheduler.snapshot()
    assert not set(snapshot.active_ids) & set(snapshot.waiting_ids)
    assert len(snapshot.active_ids) <= scheduler.config.max_active_sequences
    [(_, used)] = snapshot.component_used
    assert used <= kv_capacity


def _step(scheduler: Scheduler, run: Run, eos_every: int, elapsed_us: int) -> None:
    plan = scheduler.plan_iteration()
    config = scheduler.config
    assert plan.token_count == sum(len(w.tokens) for w in plan.work)
    assert plan.token_count <= config.max_tokens_per_iteration
    for work in plan.work:
        assert work.positions == tuple(range(work.start_position,
                                             work.start_position + len(work.tokens)))
        if work.phase is IterationPhase.RECOMPUTE:
            event("recompute")
            assert not work.sample_last
    phases = {work.phase for work in plan.work}
    if IterationPhase.DECODE in phases and len(phases) > 1:
        event("mixed plan")
    run.plans.append(tuple(plan.work))
    predictions = [
        IterationPrediction(i, -1 if eos_every and (i + len(run.plans)) % 8 == eos_every else 1)
        for i, work in enumerate(plan.work) if work.sample_last
    ]
    if elapsed_us:
        scheduler.observe_iteration_duration(plan, elapsed_us / 1e6)
    telemetry = scheduler.complete_iteration(plan, predictions)
    assert telemetry.failed_ids == ()
    run.finished.update(telemetry.finished_ids)
    run.live.difference_update(telemetry.finished_ids)


def _apply(scheduler: Scheduler, run: Run, op: tuple, names: itertools.count) -> None:
    kind = op[0]
    if kind == "submit":
        _, prompt, max_tokens, restored, matched = op
        sequence = ScheduledSequence(f"s{next(names)}", prompt, max_tokens)
        if restored:
            sequence.with_prefix_restore(PrefixRestore("page", restored))
        if matched:
            sequence.with_cache_affinity(CacheAffinity.from_stage(StageCacheAffinity(0, matched,
                                                                                      3)))
        try:
            scheduler.submit(sequence)
            run.live.add(sequence.id)
        except AdmissionError:
            pass
    elif kind == "step":
        _step(scheduler, run, op[1], op[2])
    elif kind == "cancel" and run.live:
        victim = sorted(run.live)[op[1] % len(run.live)]
        assert scheduler.cancel(victim)
        run.live.discard(victim)
    elif kind == "preempt":
        # Observed use = our reservations plus foreign pressure that preemption can absorb.
        available = scheduler.config.memory_components[0].available()
        pressure = min(op[1], available)
        if scheduler.preempt_for_component_pressure([_reserved(scheduler) + pressure]):
            event("preempted")
        scheduler.preempt_for_component_pressure([_reserved(scheduler)])  # pressure gone


def _drive(config: dict, kv_capacity: int, ops: list[tuple]) -> Run:
    scheduler = _make(config, kv_capacity)
    run = Run()
    names = itertools.count()
    for op in ops:
        _apply(scheduler, run, op, names)
        _check_state(scheduler, kv_capacity)
    # Drain: with a prediction for every sampling row, every live sequence must finish.
    for _ in range(2000):
        if not run.live:
            break
        _step(scheduler, run, 0, 0)
        _check_state(scheduler, kv_capacity)
    assert run.live == set(), f"sequences never finished: {sorted(run.live)}"
    snapshot = scheduler.snapshot()
    assert (snapshot.active_ids, snapshot.waiting_ids) == ((), ())
    assert snapshot.component_used == (("kv", 0),)
    return run


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, kv_capacity=KV_CAPACITY, ops=operations)
def test_random_workloads_keep_invariants_and_finish(config, kv_capacity, ops):
    _drive(config, kv_capacity, ops)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, kv_capacity=KV_CAPACITY, ops=operations)
def test_same_inputs_give_same_plans(config, kv_capacity, ops):
    first = _drive(config, kv_capacity, ops)
    second = _drive(config, kv_capacity, ops)
    assert first.plans == second.plans
    assert first.finished == second.finished
