"""The worker's status snapshot, published once per turn for the live view and metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LaneInfo:
    """One active sequence as the live view shows it."""

    lane: int
    """The runtime lane (sequence id) it holds, or -1 before it has one."""
    request_id: str
    phase: str
    """``prefill``, ``recompute`` or ``decode``."""
    prompt_tokens: int
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """A consistent status snapshot published by the worker once per turn."""

    num_waiting: int = 0
    num_active: int = 0
    command_queue_depth: int = 0
    direct_queue_depth: int = 0
    active_runtime_sessions: int = 0
    max_direct_batch_size: int = 1
    num_iterations: int = 0
    num_finished: int = 0
    num_failed: int = 0
    num_cancelled: int = 0
    num_rejected: int = 0
    """Generations refused because the policy's waiting queue was full."""
    num_command_queue_full: int = 0
    """Commands refused because the bounded command queue was full."""
    num_preempted: int = 0
    num_drafted: int = 0
    """Drafted tokens verified (speculative decoding)."""
    num_draft_accepted: int = 0
    """Drafted tokens accepted."""
    speculation: str = "off"
    """The stage's speculative decoding mode."""
    num_direct_iterations: int = 0
    num_runtime_operations: int = 0
    last_step_ms: float = 0.0
    last_execution_ms: float = 0.0
    last_overhead_ms: float = 0.0
    step_target_ms: float = 0.0
    """The step time prompt chunks are sized for now (the configured target, stretched
    while prompts queue up); 0 without a target."""
    failure: str | None = None
    lanes: tuple[LaneInfo, ...] = ()
    """Active planned sequences, by request id."""
    kv_cells_used: int = 0
    """KV cells held by the runtime's sessions (0 if the runtime does not say)."""

    @property
    def wave_fullness(self) -> float:
        """Share of the direct batch width occupied by runtime sessions (0..1+)."""
        return self.active_runtime_sessions / max(self.max_direct_batch_size, 1)
