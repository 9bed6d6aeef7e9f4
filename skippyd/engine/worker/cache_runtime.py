"""Runtime operations and the cache-aware runtime queue.

A runtime operation is a caller's closure run on the worker thread, the only thread
allowed to touch the runtime (KV record/restore, checkpoints, ...). Plain operations run
inline in command order; cache-aware ones (a prefix restore followed by its prefill) wait
in a :class:`CacheRuntimeQueue` and are served best cache value first, with aging and
waiting-prefix grouping, alternating with iteration work.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from skippyd.engine.policy.cache_order import (
    CacheAffinity,
    CacheAwareCandidate,
    order_cache_aware_candidates,
)
from skippyd.engine.runtime.protocol import Runtime
from skippyd.engine.worker.commands import (
    CancellationToken,
    DeadlineExceededError,
    RequestCancelledError,
)

logger = logging.getLogger(__name__)

#: Aging credit per worker turn for queued cache operations.
CACHE_AGING_COST_PER_TURN = 4096

T = TypeVar("T")


class CachePayload(enum.Enum):
    """What a cache-aware operation restores (``StagePrefixCachePayload``)."""

    RESIDENT_KV = "resident_kv"
    """Copy of KV already resident in the context: cheap, not wave-aware."""
    KV_RECURRENT = "kv_recurrent"
    """KV plus recurrent state: an exact-state restore."""
    FULL_STATE = "full_state"
    """A whole saved sequence state: an exact-state restore."""

    @property
    def is_exact_state(self) -> bool:
        return self is not CachePayload.RESIDENT_KV


def cache_runtime_wave_enabled(payload: CachePayload) -> bool:
    """Exact-state restores take part in the direct-wave gates."""
    return payload.is_exact_state


def should_serve_cache_runtime(has_cache: bool, has_iteration: bool, last_served_cache: bool) -> bool:
    """Strictly alternate cache operations and iterations when both wait."""
    if has_cache and has_iteration:
        return not last_served_cache
    return has_cache


def should_fill_cache_runtime_wave(
    has_direct: bool, has_wave_aware_cache: bool, active_sessions: int, max_batch: int
) -> bool:
    """Keep restoring while direct work waits and the native wave has free lanes."""
    return has_direct and has_wave_aware_cache and active_sessions < max_batch


def should_suppress_cache_runtime(
    has_wave_aware_cache: bool, direct_wave_full: bool, active_sessions: int, max_batch: int
) -> bool:
    """Hold restores back while a full wave of restored sessions awaits its callers."""
    return has_wave_aware_cache and direct_wave_full and active_sessions >= max_batch


def should_coalesce_direct_iterations(has_cache: bool, has_wave_aware_cache: bool) -> bool:
    """A queued resident-KV operation keeps the legacy cadence: no coalescing wait."""
    return not has_cache or has_wave_aware_cache


class ContextState(enum.Enum):
    ACTIVE = "active"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"


class CacheRuntimeContext:
    """Cancellation and deadline of one controlled runtime operation.

    The first reason to stop sticks: a deadline noticed first stays a deadline even if
    the token is cancelled later.
    """

    def __init__(
        self,
        operation_id: str,
        deadline: float | None = None,
        cancellation: CancellationToken | None = None,
    ) -> None:
        self.operation_id = operation_id
        self.deadline = deadline
        """``time.monotonic()`` instant after which the operation must stop."""
        self.cancellation = cancellation
        self._state = ContextState.ACTIVE
        self._lock = threading.Lock()

    @property
    def state(self) -> ContextState:
        return self._state

    def ensure_active(self) -> None:
        """Raise if the operation was cancelled or ran out of time.

        Raises:
            RequestCancelledError: The cancellation token fired.
            DeadlineExceededError: The deadline passed.
        """
        with self._lock:
            if self._state is ContextState.ACTIVE:
                if self.cancellation is not None and self.cancellation.is_cancelled:
                    self._state = ContextState.CANCELLED
                elif self.deadline is not None and time.monotonic() >= self.deadline:
                    self._state = ContextState.DEADLINE_EXCEEDED
            state = self._state
        if state is ContextState.CANCELLED:
            raise RequestCancelledError(f"cache runtime operation {self.operation_id} was cancelled")
        if state is ContextState.DEADLINE_EXCEEDED:
            raise DeadlineExceededError(
                f"cache runtime operation {self.operation_id} exceeded its deadline"
            )


@dataclass(slots=True)
class RuntimeOperation:
    """A closure to run on the worker thread.

    With a ``context`` the closure is called as ``fn(runtime, context)`` and may call
    ``context.ensure_active()`` at checkpoints; without one as ``fn(runtime)``.
    """

    label: str
    fn: Callable[..., Any]
    context: CacheRuntimeContext | None = None
    reply: Future[Any] | None = field(default_factory=Future)
    """None for detached operations: nobody waits for the result."""
    enqueued_at: float = field(default_factory=time.monotonic)

    def run(self, runtime: Runtime) -> Any:
        """Check the context, then run the closure; exceptions propagate."""
        if self.context is None:
            return self.fn(runtime)
        self.context.ensure_active()
        return self.fn(runtime, self.context)


@dataclass(frozen=True, slots=True)
class CacheRuntimeTelemetry:
    """How a cache operation was chosen."""

    matched_tokens: int
    saved_cost: int
    age_turns: int
    stage_hits: int
    cache_epoch: int
    wave_aware: bool
    stale_affinity_fallback: bool


@dataclass(slots=True)
class _QueuedCacheOperation(Generic[T]):
    operation: T
    affinity: CacheAffinity
    prompt_tokens: tuple[int, ...]
    priority: int
    enqueued_turn: int
    order: int
    payload: CachePayload
    refresh_affinity: Callable[[], CacheAffinity] | None
    affinity_initialized: bool
    stale_affinity_fallback: bool = False

    def telemetry(self, turn: int) -> CacheRuntimeTelemetry:
        stages = self.affinity.stages
        return CacheRuntimeTelemetry(
            matched_tokens=self.affinity.matched_tokens(),
            saved_cost=self.affinity.estimated_saved_cost(),
            age_turns=max(0, turn - self.enqueued_turn),
            stage_hits=sum(1 for stage in stages if stage.matched_tokens > 0),
            cache_epoch=max((stage.cache_epoch for stage in stages), default=0),
            wave_aware=self.payload.is_exact_state,
            stale_affinity_fallback=self.stale_affinity_fallback,
        )


class CacheRuntimeQueue(Generic[T]):
    """Cache-aware operations ordered by cache value, aging and prefix grouping.

    Only the worker thread uses it. The best operation is kept at the end of the list
    so popping it is cheap.
    """

    def __init__(
        self,
        aging_cost_per_turn: int = CACHE_AGING_COST_PER_TURN,
        group_waiting_prefixes: bool = True,
    ) -> None:
        self._operations: list[_QueuedCacheOperation[T]] = []
        self._order_dirty = False
        self._turn = 0
        self._next_order = 0
        self._aging_cost_per_turn = aging_cost_per_turn
        self._group_waiting_prefixes = group_waiting_prefixes

    def __len__(self) -> int:
        return len(self._operations)

    def is_empty(self) -> bool:
        return not self._operations

    def enqueue_lazy(
        self,
        operation: T,
        prompt_tokens: Sequence[int],
        priority: int,
        payload: CachePayload,
        refresh_affinity: Callable[[], CacheAffinity] | None,
    ) -> None:
        """Queue an operation whose affinity is computed when it is first considered."""
        self._push(operation, CacheAffinity(), prompt_tokens, priority, payload,
                   refresh_affinity, initialized=False)

    def enqueue(
        self,
        operation: T,
        affinity: CacheAffinity,
        prompt_tokens: Sequence[int],
        priority: int = 0,
        payload: CachePayload = CachePayload.RESIDENT_KV,
        refresh_affinity: Callable[[], CacheAffinity] | None = None,
    ) -> None:
        """Queue an operation with a known affinity."""
        self._push(operation, affinity, prompt_tokens, priority, payload,
                   refresh_affinity, initialized=True)

    def _push(self, operation, affinity, prompt_tokens, priority, payload, refresh, *,
              initialized: bool) -> None:
        self._operations.append(_QueuedCacheOperation(
            operation=operation, affinity=affinity, prompt_tokens=tuple(prompt_tokens),
            priority=priority, enqueued_turn=self._turn, order=self._next_order,
            payload=payload, refresh_affinity=refresh, affinity_initialized=initialized,
        ))
        self._next_order += 1
        self._order_dirty = True

    def advance_turn(self) -> None:
        """Age every queued operation by one turn (the worker calls this once per turn)."""
        self._turn += 1

    def has_wave_aware_operations(self) -> bool:
        return any(entry.payload.is_exact_state for entry in self._operations)

    def pop_next(self) -> tuple[T, CacheRuntimeTelemetry] | None:
        """Refresh affinities, reorder if needed, and take the best operation."""
        if not self._operations:
            return None
        self._refresh_affinities()
        self._reorder_if_dirty()
        entry = self._operations.pop()
        return entry.operation, entry.telemetry(self._turn)

    def drain(self) -> list[T]:
        """Remove and return every queued operation (worker shutdown)."""
        operations = [entry.operation for entry in self._operations]
        self._operations.clear()
        return operations

    def _refresh_affinities(self) -> None:
        for entry in self._operations:
            if entry.refresh_affinity is None:
                continue
            try:
                affinity = entry.refresh_affinity()
            except Exception:
                # A failing lookup must not stall the queue; keep the last known value.
                logger.exception("cache affinity refresh failed; keeping the previous value")
                continue
            if not entry.affinity_initialized:
                entry.affinity, entry.affinity_initialized = affinity, True
                self._order_dirty = True
            elif affinity != entry.affinity:
                entry.affinity, entry.stale_affinity_fallback = affinity, True
                self._order_dirty = True

    def _reorder_if_dirty(self) -> None:
        if not self._order_dirty:
            return
        candidates = [
            CacheAwareCandidate(
                index=index, priority=entry.priority, affinity=entry.affinity,
                prompt_tokens=entry.prompt_tokens, enqueued_turn=entry.enqueued_turn,
                order=entry.order,
            )
            for index, entry in enumerate(self._operations)
        ]
        ordered = order_cache_aware_candidates(
            candidates, self._turn, self._aging_cost_per_turn, self._group_waiting_prefixes
        )
        self._order_dirty = False
        if sorted(ordered) != list(range(len(self._operations))):
            return
        # Best last, so pop() takes it.
        self._operations = [self._operations[index] for index in reversed(ordered)]
