"""In-process telemetry hub: the engine publishes typed events, observers subscribe.

The worker must never wait on an observer (the
worker thread owns every runtime call, so a slow dashboard must not slow decoding). A
:class:`TelemetryHub` therefore hands each event to every subscriber's own bounded
deque; when a deque is full its oldest event is dropped and counted. Subscribers read
at their own pace, from any thread, with :meth:`Subscription.get`, :meth:`wait_for` or
:meth:`drain`, and may ask for a cheap wake-up callback (for example
``loop.call_soon_threadsafe``) to avoid polling. Each subscription has a level
(:mod:`skippyd.engine.telemetry_events`): a ``summary`` subscriber never sees debug
events, and a debug event nobody wants is not built (:meth:`TelemetryHub.wants`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from skippyd.engine.telemetry_events import (
    LEVELS,
    ComponentBytes,
    EventLevel,
    StepFinished,
    TelemetryPayload,
    WorkerStarted,
)

if TYPE_CHECKING:
    from skippyd.engine.policy.counters import IterationTelemetry
    from skippyd.engine.worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

#: Default per-subscriber buffer, in events.
DEFAULT_SUBSCRIPTION_MAXLEN = 1024

#: Name of the cache-aware ordering, reported at scheduler start.
CACHE_POLICY_NAME = "weighted_lpm_aging_dfs_waiting_prefix"


@dataclass(frozen=True, slots=True)
class TelemetryEvent:
    """One published event: what happened, and when."""

    payload: TelemetryPayload
    seq: int
    """Hub-wide publication counter, starting at 1."""
    timestamp_s: float
    """Wall-clock time of publication (``time.time()``)."""
    level: EventLevel = field(default="summary")

    @property
    def name(self) -> str:
        """The wire name, e.g. ``request.finished``."""
        return self.payload.NAME

    @property
    def attributes(self) -> Mapping[str, Any]:
        """The payload's fields as the control socket sends them."""
        return self.payload.wire_attributes()


class Subscription:
    """A bounded, thread-safe mailbox of events for one observer.

    Create it with :meth:`TelemetryHub.subscribe`; close it with :meth:`close` (or use
    it as a context manager) so the hub stops delivering to it.
    """

    def __init__(
        self,
        hub: TelemetryHub,
        maxlen: int,
        notify: Callable[[], None] | None = None,
        level: EventLevel = "debug",
    ) -> None:
        self._hub = hub
        self.level = level
        """The most detailed level this subscriber receives."""
        self._events: deque[TelemetryEvent] = deque()
        self._maxlen = maxlen
        self._notify = notify
        self._cond = threading.Condition()
        self._num_dropped = 0
        self._closed = False
        self._last_seq = -1

    @property
    def num_dropped(self) -> int:
        """Events discarded because this subscriber fell ``maxlen`` events behind."""
        return self._num_dropped

    @property
    def closed(self) -> bool:
        return self._closed

    def offer(self, event: TelemetryEvent) -> None:
        """Append ``event`` without blocking, dropping the oldest when full.

        Called by the hub on the publishing thread.
        """
        with self._cond:
            if self._closed:
                return
            if len(self._events) >= self._maxlen:
                self._events.popleft()
                self._num_dropped += 1
            self._events.append(event)
            self._last_seq = event.seq
            self._cond.notify_all()
        if self._notify is not None:
            try:
                self._notify()
            except Exception:  # an observer bug must never reach the publisher
                logger.exception("telemetry notify callback failed")

    def get(self, timeout_s: float | None = None) -> TelemetryEvent | None:
        """Pop the oldest event, waiting up to ``timeout_s`` for one; None on timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._events or self._closed, timeout_s):
                return None
            return self._events.popleft() if self._events else None

    def wait_for(
        self,
        predicate: Callable[[TelemetryEvent], bool],
        timeout_s: float,
    ) -> TelemetryEvent | None:
        """Consume events until one satisfies ``predicate``; None after ``timeout_s``.

        Events that do not match are discarded.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            event = self.get(max(0.0, deadline - time.monotonic()))
            if event is None:
                return None
            if predicate(event):
                return event

    def drain(self) -> list[TelemetryEvent]:
        """Pop and return every buffered event, oldest first, without waiting."""
        with self._cond:
            events = list(self._events)
            self._events.clear()
            return events

    @property
    def last_offered_seq(self) -> int:
        """``seq`` of the newest event offered so far (-1 before the first).

        Read from a ``notify`` callback, it names the event just delivered (with one
        publishing thread; with several, possibly a later one): a consumer that hands
        the number to another thread can fold events in the order they were published
        relative to its other messages (:meth:`drain_through`).
        """
        with self._cond:
            return self._last_seq

    def drain_through(self, seq: int) -> list[TelemetryEvent]:
        """Pop and return the buffered events up to ``seq`` included, oldest first."""
        with self._cond:
            events = []
            while self._events and self._events[0].seq <= seq:
                events.append(self._events.popleft())
            return events

    def close(self) -> None:
        """Stop receiving events and wake any waiter. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._hub.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class TelemetryHub:
    """Fan-out of telemetry events to independent, bounded subscriptions.

    ``publish`` never blocks on a subscriber: the subscriber list is an immutable tuple
    replaced on (un)subscribe, and each delivery only appends to a bounded deque.
    """

    def __init__(self) -> None:
        self._subscribers: tuple[Subscription, ...] = ()
        self._debug = False
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._num_published = 0

    @property
    def num_published(self) -> int:
        """Events published since the hub was created."""
        return self._num_published

    def wants(self, level: EventLevel) -> bool:
        """Whether any subscriber receives events of ``level`` (build none otherwise)."""
        return level == "summary" or self._debug

    def publish(self, payload: TelemetryPayload) -> None:
        """Deliver an event to every subscriber of its level, never blocking."""
        level = payload.level
        if level == "debug" and not self._debug:
            return
        event = TelemetryEvent(payload, next(self._seq), time.time(), level)
        self._num_published += 1
        for subscription in self._subscribers:
            if level == "summary" or subscription.level == "debug":
                subscription.offer(event)

    def subscribe(
        self,
        maxlen: int = DEFAULT_SUBSCRIPTION_MAXLEN,
        notify: Callable[[], None] | None = None,
        level: EventLevel = "debug",
    ) -> Subscription:
        """Start receiving events published from now on.

        Args:
            maxlen: Events buffered before the oldest are dropped; at least 1.
            notify: Optional callback run (on the publisher's thread, so it must be
                quick and non-blocking) after each delivery.
            level: ``summary`` receives the events an operator looks for; ``debug`` also
                the per-step ones.

        Raises:
            ValueError: ``maxlen`` is below 1, or an unknown level.
        """
        if maxlen < 1:
            raise ValueError(f"maxlen: must be >= 1 (got {maxlen})")
        if level not in LEVELS:
            raise ValueError(f"level: one of {', '.join(LEVELS)} (got {level!r})")
        subscription = Subscription(self, maxlen, notify, level)
        with self._lock:
            self._subscribers = (*self._subscribers, subscription)
            self._debug = any(s.level == "debug" for s in self._subscribers)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """Stop delivering to ``subscription``. Idempotent."""
        with self._lock:
            self._subscribers = tuple(s for s in self._subscribers if s is not subscription)
            self._debug = any(s.level == "debug" for s in self._subscribers)


def publish_worker_start(hub: TelemetryHub, settings: WorkerSettings) -> None:
    """Publish :class:`WorkerStarted`: how the worker was sized."""
    policy = settings.policy
    hub.publish(WorkerStarted(
        safe_mode=settings.safe_mode, command_queue_capacity=settings.command_queue_capacity,
        max_active_sequences=policy.max_active_sequences,
        max_consecutive_prefill_iterations=policy.max_consecutive_prefill_iterations,
        mixed_prefill_decode=policy.mixed_prefill_decode, cache_policy=CACHE_POLICY_NAME))


def step_finished(step: IterationTelemetry, step_ms: float,
                  execution_ms: float) -> StepFinished:
    """The :class:`StepFinished` event of one planned step."""
    available = dict(step.component_available)
    return StepFinished(
        iteration=step.iteration, running=step.active_sequences,
        waiting=step.waiting_sequences, admitted=step.admitted, preempted=step.preempted,
        prefill_tokens=step.prefill_tokens, recompute_tokens=step.recompute_tokens,
        decode_tokens=step.decode_tokens, prefix_hits=step.prefix_hits,
        prefix_misses=step.prefix_misses, step_ms=step_ms, execution_ms=execution_ms,
        finished=step.finished, failed=step.failed, cancelled=step.cancelled,
        rejected_overload=step.rejected_overload,
        components=tuple(ComponentBytes(name, used, available.get(name, 0))
                         for name, used in step.component_used))
