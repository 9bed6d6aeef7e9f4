"""What the engine tells its observers: one frozen dataclass per kind of event.

The worker, the prefix cache and a split stage's chain publish these on the
:class:`~skippyd.engine.worker.telemetry.TelemetryHub`; in-process observers (the
request metrics) read their fields, and the control socket encodes them with
:meth:`TelemetryPayload.wire_attributes` (names and keys are documented in
``docs/control-protocol.md``; nothing else spells them).

Every kind has a level: ``summary`` events are what an operator looks for (a request
admitted, preempted or finished and why, cache hits and demotions, a failure, the chain
going up or down); ``debug`` events come once per step or operation. An observer
subscribes at a level (``telemetry.level`` for the control socket), and a debug event
that no subscriber wants is not built at all (:meth:`TelemetryHub.wants`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

EventLevel = Literal["summary", "debug"]
LEVELS: tuple[EventLevel, ...] = ("summary", "debug")


@dataclass(frozen=True, slots=True)
class TelemetryPayload:
    """Base of every event: its wire name, its level, and its attributes."""

    NAME: ClassVar[str] = ""
    LEVEL: ClassVar[EventLevel] = "summary"

    @property
    def level(self) -> EventLevel:
        """This event's level (the kind's, unless the kind decides per event)."""
        return self.LEVEL

    def wire_attributes(self) -> dict[str, Any]:
        """The event's fields as JSON types, keyed by field name."""
        return {field.name: getattr(self, field.name) for field in fields(self)}


# -- the worker ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkerStarted(TelemetryPayload):
    """The worker started: how it was sized."""

    NAME: ClassVar[str] = "worker.start"

    safe_mode: bool
    command_queue_capacity: int
    max_active_sequences: int
    max_consecutive_prefill_iterations: int
    mixed_prefill_decode: bool
    cache_policy: str


@dataclass(frozen=True, slots=True)
class ComponentBytes:
    """The memory one component (``kv``, ``recurrent``) holds against its budget."""

    name: str
    used: int
    available: int


@dataclass(frozen=True, slots=True)
class StepFinished(TelemetryPayload):
    """One planned step of stage 0's worker ran."""

    NAME: ClassVar[str] = "worker.step"
    LEVEL: ClassVar[EventLevel] = "debug"

    iteration: int
    running: int
    waiting: int
    admitted: int
    preempted: int
    prefill_tokens: int
    recompute_tokens: int
    decode_tokens: int
    prefix_hits: int
    prefix_misses: int
    step_ms: float
    execution_ms: float
    finished: int
    failed: int
    cancelled: int
    rejected_overload: int
    components: tuple[ComponentBytes, ...] = ()

    @property
    def overhead_ms(self) -> float:
        """The step's time outside the model call."""
        return max(0.0, self.step_ms - self.execution_ms)

    def wire_attributes(self) -> dict[str, Any]:
        attributes = {field.name: getattr(self, field.name) for field in fields(self)
                      if field.name != "components"}
        attributes["overhead_ms"] = self.overhead_ms
        for part in self.components:
            attributes[f"{part.name}_used"] = part.used
            attributes[f"{part.name}_available"] = part.available
        return attributes


@dataclass(frozen=True, slots=True)
class DirectBatchFinished(TelemetryPayload):
    """A later stage's worker ran one batch of direct iterations."""

    NAME: ClassVar[str] = "worker.direct_batch"
    LEVEL: ClassVar[EventLevel] = "debug"

    batch_size: int
    token_count: int
    batch_wait_max_ms: float
    """The longest an iteration of the batch waited in the queue."""
    runtime_ms: float
    """The batch's runtime call."""


@dataclass(frozen=True, slots=True)
class RuntimeOperationFinished(TelemetryPayload):
    """An operation a caller asked the worker to run on the runtime finished."""

    NAME: ClassVar[str] = "worker.runtime_operation"
    LEVEL: ClassVar[EventLevel] = "debug"

    operation: str
    operation_ms: float


@dataclass(frozen=True, slots=True)
class WorkerFailed(TelemetryPayload):
    """The worker failed (a bug it contained): every request it held was answered."""

    NAME: ClassVar[str] = "worker.failed"

    failure: str


# -- requests -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RequestAdmitted(TelemetryPayload):
    """A request got a lane; its prompt is computed from now on."""

    NAME: ClassVar[str] = "request.admitted"

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    """Leading prompt tokens restored from the prefix cache instead of computed."""
    queued_ms: float
    """From submission to admission."""


@dataclass(frozen=True, slots=True)
class RequestPreempted(TelemetryPayload):
    """A running request gave up its lane; it recomputes its tokens when readmitted."""

    NAME: ClassVar[str] = "request.preempted"

    request_id: str
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class RequestFinished(TelemetryPayload):
    """A request left the worker: its one final event was sent."""

    NAME: ClassVar[str] = "request.finished"

    request_id: str
    reason: str
    """``stop`` or ``length`` when it completed, else the error code (``cancelled``,
    ``admission_timeout``, ``stalled``, ``backend``, ...)."""
    prompt_tokens: int
    generated_tokens: int
    message: str = ""
    """The error's message, empty when it completed."""


# -- the prefix cache ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PrefixCacheChanged(TelemetryPayload):
    """A prefix-cache operation, with the cache's counters after it.

    Lookups and restores are per request (debug); records, demotions and drops change
    what the cache holds (summary).
    """

    NAME: ClassVar[str] = "prefix_cache.change"
    SUMMARY_OPERATIONS: ClassVar[frozenset[str]] = frozenset({"record", "demote", "drop"})

    operation: str
    tokens: int
    tier: str
    epoch: int
    counters: tuple[tuple[str, int | float], ...] = ()

    @property
    def level(self) -> EventLevel:
        return "summary" if self.operation in self.SUMMARY_OPERATIONS else "debug"

    def wire_attributes(self) -> dict[str, Any]:
        return {"operation": self.operation, "tokens": self.tokens, "tier": self.tier,
                "epoch": self.epoch, **dict(self.counters)}


# -- a split stage's chain ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ChainUp(TelemetryPayload):
    """Stage 0 connected to the rest of its pipeline."""

    NAME: ClassVar[str] = "chain.up"

    epoch: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class ChainDown(TelemetryPayload):
    """Stage 0 lost the rest of its pipeline."""

    NAME: ClassVar[str] = "chain.down"

    epoch: int
    reason: str


#: Every kind of event, by wire name (for documentation and tests).
KINDS: dict[str, type[TelemetryPayload]] = {kind.NAME: kind for kind in (
    WorkerStarted, StepFinished, DirectBatchFinished, RuntimeOperationFinished, WorkerFailed,
    RequestAdmitted, RequestPreempted, RequestFinished, PrefixCacheChanged, ChainUp,
    ChainDown)}
