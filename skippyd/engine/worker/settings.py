"""How the worker derives its policy configuration from the runtime.

The policy scheduler is generic; the stage decides its limits from facts about the
runtime: lanes, the shared KV cell pool, the model's recurrent state, the native batch
sizes and whether the stage exports activations downstream.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from skippyd.engine.policy.config import UNLIMITED, MemoryComponent, SchedulerConfig
from skippyd.engine.worker.direct_batch import (
    MAX_NATIVE_ITERATION_TOKENS,
    pipeline_group_batch_size,
)

logger = logging.getLogger(__name__)

#: Default prefill chunk when the stage does not configure ``n_ubatch``.
DEFAULT_PREFILL_CHUNK_TOKENS = 256
#: llama-server's default micro-batch, the export cap without ``n_ubatch``.
LLAMA_SERVER_DEFAULT_N_UBATCH = 512
#: Decode headroom reserved at admission beyond the prompt.
DECODE_BATCH_HEADROOM_TOKENS = 512
#: Aging credit per turn a waiting request gains in the cache-aware order.
CACHE_AGING_COST_PER_ITERATION = 4096
#: The command queue never holds fewer commands than this.
MIN_COMMAND_QUEUE_CAPACITY = 8
#: Commands handled per worker turn at most.
MAX_COMMANDS_PER_TURN = 64
#: Name of the KV memory component; it counts tokens (1 per token).
KV_COMPONENT = "kv-cells"
RECURRENT_COMPONENT = "recurrent-state"


def iteration_token_budget(exports: bool, budget: int, n_ubatch: int | None) -> int:
    """Cap an exporting stage's iterations at one native micro-batch.

    A stage with a downstream consumer ships every planned iteration as one activation
    frame; keeping it within one micro-batch lets the next stage start sooner.
    """
    if not exports:
        return budget
    return min(budget, n_ubatch or LLAMA_SERVER_DEFAULT_N_UBATCH)


def build_scheduler_config(
    lanes: int,
    kv_pool_tokens: int,
    recurrent_bytes_per_seq: int,
    n_batch: int | None,
    n_ubatch: int | None,
    queue_capacity: int,
    exports: bool = False,
) -> SchedulerConfig:
    """Build the normalized policy configuration of a stage.

    Args:
        lanes: Scheduler lane count (1 in safe mode or without continuous batching).
        kv_pool_tokens: Cells of the shared KV pool.
        recurrent_bytes_per_seq: Recurrent state of one sequence over this stage's layers.
        n_batch: Native batch size, if configured.
        n_ubatch: Native micro-batch size, if configured.
        queue_capacity: Waiting-queue capacity.
        exports: The stage sends activations to a downstream stage.
    """
    max_tokens = min(max(n_batch or MAX_NATIVE_ITERATION_TOKENS, 1), MAX_NATIVE_ITERATION_TOKENS)
    max_tokens = iteration_token_budget(exports, max_tokens, n_ubatch)
    chunk = min(max(n_ubatch or DEFAULT_PREFILL_CHUNK_TOKENS, 1), max_tokens)
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
        reserved_sequence_ids=0,
        max_waiting_sequences=max(queue_capacity, 1),
        max_tokens_per_iteration=max_tokens,
        prefill_chunk_tokens=chunk,
        # Recurrent models slow down badly with several prompt rows in one native call.
        max_prefill_sequences_per_iteration=1 if recurrent else UNLIMITED,
        max_consecutive_prefill_iterations=1,
        # A mixed probe permanently slowed recurrent decode by 9-20 %.
        mixed_prefill_decode=not recurrent,
        cache_aging_cost_per_iteration=CACHE_AGING_COST_PER_ITERATION,
        group_waiting_prefixes=True,
        iteration_interval_s=0.0,
        memory_components=tuple(components),
    ).normalized()


def kv_capacity_tokens(config: SchedulerConfig) -> int:
    """Capacity of the first (``kv-cells``) memory component, or 1."""
    if not config.memory_components:
        return 1
    return config.memory_components[0].capacity_bytes


def admission_tokens(prompt_tokens: int, max_tokens: int, kv_capacity: int) -> int:
    """Tokens reserved at admission: the prompt plus bounded decode headroom.

    Reserving the client's whole ``max_tokens`` would let one long request block many
    short ones; the policy raises the result back to at least the prompt length.
    """
    return min(prompt_tokens + min(max_tokens, DECODE_BATCH_HEADROOM_TOKENS), kv_capacity)


def recurrent_bytes_per_native_sequence(
    model_path: str | os.PathLike[str] | None,
    layer_start: int = 0,
    layer_end: int | None = None,
) -> int:
    """Recurrent state one sequence keeps over ``[layer_start, layer_end)``; 0 if unknown."""
    if model_path is None:
        return 0
    from skippyd.gguf.inspect import inspect_model  # deferred: reads the GGUF

    try:
        return inspect_model(model_path).recurrent_bytes(layer_start, layer_end)
    except Exception as exc:  # any unreadable model means "no recurrent state known"
        logger.warning("cannot read recurrent state size from %s: %s", model_path, exc)
        return 0


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """Sizes the worker derives at construction."""

    max_direct_batch_size: int
    """Most direct iterations in one runtime call: the scheduler lane count."""
    direct_group_batch_size: int
    """Direct batch width per pipeline decode group."""
    max_direct_iteration_tokens: int
    """Token budget of one direct batch (and limit of one direct iteration)."""
    max_commands_per_turn: int
    command_queue_capacity: int = MIN_COMMAND_QUEUE_CAPACITY
    iteration_interval_s: float = 0.0


def make_worker_settings(
    lanes: int,
    queue_capacity: int,
    n_batch: int | None,
    decode_groups: int,
    config: SchedulerConfig,
) -> WorkerSettings:
    """Derive the worker's sizes from the scheduler lane count and queue capacity."""
    capacity = max(queue_capacity + lanes, MIN_COMMAND_QUEUE_CAPACITY)
    max_batch = max(lanes, 1)
    return WorkerSettings(
        max_direct_batch_size=max_batch,
        direct_group_batch_size=pipeline_group_batch_size(max_batch, decode_groups),
        max_direct_iteration_tokens=min(max(n_batch or MAX_NATIVE_ITERATION_TOKENS, 1),
                                        MAX_NATIVE_ITERATION_TOKENS),
        max_commands_per_turn=min(capacity, MAX_COMMANDS_PER_TURN),
        command_queue_capacity=capacity,
        iteration_interval_s=config.iteration_interval_s,
    )
