"""How the worker is sized: derived once per stage from its config and its runtime.

The policy scheduler is generic; the stage decides its limits from facts about the
runtime (lanes, the shared KV cell pool, ``n_batch`` and ``n_ubatch`` as the context was
built with them), about the model (recurrent state) and from the stage config (queue
capacity, safe mode, continuous batching, whether it sends activations on, pipeline
decode groups). :meth:`WorkerSettings.for_stage` is the one place that happens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from skippyd.config import StageConfig
from skippyd.engine.policy.config import (
    PIPELINE_SAMPLE_TAIL,
    UNLIMITED,
    MemoryComponent,
    SchedulerConfig,
)
from skippyd.engine.runtime.contract import Runtime
from skippyd.engine.worker.direct_batch import (
    MAX_NATIVE_ITERATION_TOKENS,
    pipeline_group_batch_size,
)

logger = logging.getLogger(__name__)

#: Decode headroom reserved at admission beyond the prompt.
DECODE_BATCH_HEADROOM_TOKENS = 512
#: Aging credit per turn a waiting request gains in the cache-aware order.
CACHE_AGING_COST_PER_ITERATION = 4096
#: The command queue never holds fewer commands than this.
MIN_COMMAND_QUEUE_CAPACITY = 8
#: Commands handled per worker turn at most.
MAX_COMMANDS_PER_TURN = 64
#: Most seconds a worker starting from idle waits for the rest of a burst of requests
#: (:mod:`~skippyd.engine.worker.arrivals`) before its first step.
BURST_WAIT_S = 0.05
#: Name of the KV memory component; it counts tokens (1 per token).
KV_COMPONENT = "kv-cells"
RECURRENT_COMPONENT = "recurrent-state"


def iteration_token_budget(exports: bool, budget: int, n_ubatch: int) -> int:
    """Cap an exporting stage's iterations at one native micro-batch.

    A stage with a downstream consumer ships every planned iteration as one activation
    frame; keeping it within one micro-batch lets the next stage start sooner.
    """
    return min(budget, n_ubatch) if exports else budget


def effective_lane_count(lanes: int, safe_mode: bool, continuous_batching: bool) -> int:
    """One lane in safe mode or without continuous batching, else ``lanes``."""
    return 1 if safe_mode or not continuous_batching else lanes


def build_scheduler_config(
    lanes: int,
    kv_pool_tokens: int,
    recurrent_bytes_per_seq: int,
    n_batch: int,
    n_ubatch: int,
    queue_capacity: int,
    exports: bool = False,
    target_step_ms: float = 0.0,
    target_decode_steps: float = 0.0,
) -> SchedulerConfig:
    """Build the normalized policy configuration of a stage.

    Args:
        lanes: Scheduler lane count (1 in safe mode or without continuous batching).
        kv_pool_tokens: Cells of the shared KV pool.
        recurrent_bytes_per_seq: Recurrent state of one sequence over this stage's layers.
        n_batch: The runtime's batch size: the iteration budget (at most 2048).
        n_ubatch: The runtime's micro-batch size: the prefill chunk, and the budget of
            a stage that sends activations on.
        queue_capacity: Waiting-queue capacity.
        exports: The stage sends activations to a downstream stage.
        target_step_ms: Step time that sizes prompt chunks beside decode rows (0: off).
        target_decode_steps: The step time is at least this many decode steps (0: off).
    """
    max_tokens = min(max(n_batch, 1), MAX_NATIVE_ITERATION_TOKENS)
    max_tokens = iteration_token_budget(exports, max_tokens, max(n_ubatch, 1))
    recurrent = recurrent_bytes_per_seq > 0
    components = [MemoryComponent(KV_COMPONENT, max(kv_pool_tokens, 1), 0, 1, 0)]
    if recurrent:
        # Native recurrent contexts reserve two sequence slots per lane; the per-sequence
        # value already includes the three state planes.
        components.append(MemoryComponent(
            RECURRENT_COMPONENT, recurrent_bytes_per_seq * lanes * 2, 0, 0,
            recurrent_bytes_per_seq,
        ))
    return SchedulerConfig(
        max_active_sequences=max(lanes, 1),
        max_waiting_sequences=max(queue_capacity, 1),
        max_tokens_per_iteration=max_tokens,
        prefill_chunk_tokens=min(max(n_ubatch, 1), max_tokens),
        # Recurrent models slow down badly with several prompt rows in one native call.
        max_prefill_sequences_per_iteration=1 if recurrent else UNLIMITED,
        max_consecutive_prefill_iterations=1,
        # Mixing prompt rows into a recurrent model's decode steps slows its decode for good.
        mixed_prefill_decode=not recurrent,
        target_step_us=round(target_step_ms * 1000),
        target_decode_steps=target_decode_steps,
        sample_tail_tokens=PIPELINE_SAMPLE_TAIL if exports else 0,
        cache_aging_cost_per_iteration=CACHE_AGING_COST_PER_ITERATION,
        group_waiting_prefixes=True,
        memory_components=tuple(components),
    ).normalized()


def kv_capacity_tokens(config: SchedulerConfig) -> int:
    """Capacity of the first (``kv-cells``) memory component, or 1."""
    if not config.memory_components:
        return 1
    return config.memory_components[0].capacity


def admission_tokens(prompt_tokens: int, max_tokens: int, kv_capacity: int) -> int:
    """Tokens reserved at admission: the prompt plus bounded decode headroom.

    Reserving the client's whole ``max_tokens`` would let one long request block many
    short ones; the policy raises the result back to at least the prompt length.
    """
    return min(prompt_tokens + min(max_tokens, DECODE_BATCH_HEADROOM_TOKENS), kv_capacity)


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """Everything the worker is sized by; build it with :meth:`for_stage` or :meth:`derive`."""

    policy: SchedulerConfig
    """The normalized policy configuration."""
    safe_mode: bool
    """One lane, whatever the runtime has (reported at start)."""
    max_direct_batch_size: int
    """Most direct iterations in one runtime call: the scheduler lane count."""
    direct_group_batch_size: int
    """Direct batch width per pipeline decode group."""
    max_direct_iteration_tokens: int
    """Token budget of one direct batch (and limit of one direct iteration)."""
    max_commands_per_turn: int
    """Commands the worker handles per turn at most."""
    command_queue_capacity: int
    """Bound of the command queue: queue capacity plus lanes, at least 8."""
    admission_timeout_s: float = 0.0
    """A request still waiting for a lane after this long ends with an error (0: never)."""
    burst_wait_s: float = BURST_WAIT_S
    """Most seconds a worker starting from idle waits for requests arriving together."""
    stall_timeout_s: float = 0.0
    """An admitted request that makes no progress for this long ends with an error
    (0: never)."""

    @classmethod
    def for_stage(cls, config: StageConfig, runtime: Runtime,
                  recurrent_bytes_per_seq: int = 0) -> WorkerSettings:
        """The settings of the worker of the stage ``config`` describes.

        Args:
            config: The stage config (environment switches already folded in).
            runtime: The runtime the worker will drive; its lanes, KV pool and batch
                sizes are the ones llama.cpp was built with.
            recurrent_bytes_per_seq: Recurrent state of one sequence over the stage's
                layers (0 for attention-only models).
        """
        rt = config.runtime
        return cls.derive(runtime, queue_capacity=rt.queue_capacity, safe_mode=rt.safe_mode,
                          continuous_batching=rt.continuous_batching,
                          recurrent_bytes_per_seq=recurrent_bytes_per_seq,
                          exports=not config.is_final,
                          decode_groups=config.planned_decode_groups or 1,
                          target_step_ms=rt.target_step_ms,
                          target_decode_steps=rt.target_decode_steps,
                          admission_timeout_s=rt.admission_timeout_s,
                          stall_timeout_s=rt.stall_timeout_s)

    @classmethod
    def derive(cls, runtime: Runtime, *, queue_capacity: int, safe_mode: bool = False,
               continuous_batching: bool = True, recurrent_bytes_per_seq: int = 0,
               exports: bool = False, decode_groups: int = 1,
               target_step_ms: float = 0.0, target_decode_steps: float = 0.0,
               admission_timeout_s: float = 0.0, stall_timeout_s: float = 0.0,
               burst_wait_s: float = BURST_WAIT_S) -> WorkerSettings:
        """The settings from explicit stage facts (:meth:`for_stage` reads them from a config).

        Raises:
            ValueError: ``queue_capacity`` is below 1, or a timeout is negative.
        """
        if queue_capacity < 1:
            raise ValueError(f"queue_capacity: must be >= 1 (got {queue_capacity})")
        for name, value in (("admission_timeout_s", admission_timeout_s),
                            ("stall_timeout_s", stall_timeout_s),
                            ("burst_wait_s", burst_wait_s)):
            if value < 0:
                raise ValueError(f"{name}: must be >= 0 (got {value})")
        lanes = effective_lane_count(runtime.lane_count, safe_mode, continuous_batching)
        policy = build_scheduler_config(
            lanes, runtime.kv_pool_tokens, recurrent_bytes_per_seq, runtime.max_batch_tokens,
            runtime.micro_batch_tokens, queue_capacity, exports, target_step_ms,
            target_decode_steps)
        capacity = max(queue_capacity + lanes, MIN_COMMAND_QUEUE_CAPACITY)
        max_batch = max(lanes, 1)
        return cls(
            policy=policy,
            safe_mode=safe_mode,
            max_direct_batch_size=max_batch,
            direct_group_batch_size=pipeline_group_batch_size(max_batch, decode_groups),
            max_direct_iteration_tokens=min(max(runtime.max_batch_tokens, 1),
                                            MAX_NATIVE_ITERATION_TOKENS),
            max_commands_per_turn=min(capacity, MAX_COMMANDS_PER_TURN),
            command_queue_capacity=capacity,
            admission_timeout_s=admission_timeout_s,
            stall_timeout_s=stall_timeout_s,
            burst_wait_s=burst_wait_s,
        )
