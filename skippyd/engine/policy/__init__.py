"""Pure scheduling policy: admission, iteration planning, preemption.

Nothing but the standard library: no threads, no I/O and no runtime here. A driver (the
worker thread, or the scheduler lab on a virtual clock) calls ``Scheduler.plan_iteration``,
executes the plan, and reports the sampled tokens with ``Scheduler.complete_iteration``.
"""

from skippyd.engine.policy.cache_order import (
    CacheAffinity,
    CacheAwareCandidate,
    StageCacheAffinity,
    order_cache_aware_candidates,
    waiting_prefix_dfs_order,
)
from skippyd.engine.policy.calibration import (
    DURATION_EWMA_ALPHA,
    MIXED_DECODE_SLOWDOWN_FRACTION,
    MIXED_PREFILL_MAX_EXTRA_US,
    MIXED_PREFILL_MIN_EXTRA_US,
)
from skippyd.engine.policy.capacity import (
    CapacityDemand,
    CapacityPlan,
    ComponentCapacitySnapshot,
    EvictableCacheEntry,
    plan_component_capacity,
)
from skippyd.engine.policy.config import (
    LLAMA_MAX_SEQ,
    UNLIMITED,
    MemoryComponent,
    SchedulerConfig,
)
from skippyd.engine.policy.counters import (
    IterationTelemetry,
    SchedulerMetrics,
    SchedulerSnapshot,
    SequenceProgress,
)
from skippyd.engine.policy.input_errors import (
    AdmissionError,
    AdmissionErrorKind,
    DuplicateSequenceError,
    EmptyPromptError,
    PolicyInputError,
    SchedulerConfigError,
    WaitingQueueFullError,
)
from skippyd.engine.policy.plan import (
    IterationPhase,
    IterationPlan,
    IterationPrediction,
    IterationWork,
)
from skippyd.engine.policy.scheduler import Scheduler
from skippyd.engine.policy.sequence import (
    PrefixRestore,
    PrefixRestoreKind,
    ScheduledSequence,
    SequenceStatus,
)

__all__ = [
    "DURATION_EWMA_ALPHA",
    "LLAMA_MAX_SEQ",
    "MIXED_DECODE_SLOWDOWN_FRACTION",
    "MIXED_PREFILL_MAX_EXTRA_US",
    "MIXED_PREFILL_MIN_EXTRA_US",
    "UNLIMITED",
    "AdmissionError",
    "AdmissionErrorKind",
    "CacheAffinity",
    "CacheAwareCandidate",
    "CapacityDemand",
    "CapacityPlan",
    "ComponentCapacitySnapshot",
    "DuplicateSequenceError",
    "EmptyPromptError",
    "EvictableCacheEntry",
    "IterationPhase",
    "IterationPlan",
    "IterationPrediction",
    "IterationTelemetry",
    "IterationWork",
    "MemoryComponent",
    "PolicyInputError",
    "PrefixRestore",
    "PrefixRestoreKind",
    "WaitingQueueFullError",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerConfigError",
    "SchedulerMetrics",
    "SchedulerSnapshot",
    "ScheduledSequence",
    "SequenceProgress",
    "SequenceStatus",
    "StageCacheAffinity",
    "order_cache_aware_candidates",
    "plan_component_capacity",
    "waiting_prefix_dfs_order",
]
