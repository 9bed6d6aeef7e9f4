"""One generation's lifecycle as the HTTP side sees it, reported to the serving metrics.

Timestamps come from the metrics' clock on the event loop thread: submit, admission
(the worker's admission event), first and last token, end. The request log line and
the latency windows are computed from them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from skippyd.engine.worker.generation_events import (
    AdmittedEvent,
    CompleteEvent,
    ErrorEvent,
    GenerationEvent,
    TokenEvent,
)
from skippyd.http.observability.request_log import CLIENT_CLOSED

if TYPE_CHECKING:
    from skippyd.http.observability.metrics import ServingMetrics

logger = logging.getLogger(__name__)


class RequestTimer:
    """One generation's lifecycle, reported to :class:`ServingMetrics`.

    Every method is idempotent after the request reached a terminal state, so callers
    may report liberally (a token that arrives after a consumer Stop is ignored).
    """

    def __init__(self, metrics: ServingMetrics, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_generated_tokens = 0
        self.num_cached_tokens = 0
        self.num_drafted = 0
        """Drafted tokens verified for it (speculative decoding)."""
        self.num_draft_accepted = 0
        """Prompt tokens restored from the prefix cache, once admitted."""
        self.submitted_at = metrics.clock()
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.outcome: str | None = None
        """None while running; then "stop", "length", "failed", "cancelled" or "rejected"."""
        self.status: int | None = None
        """The HTTP status the client saw, once ended (499: the client went away)."""
        self.ended_at: float | None = None
        self._metrics = metrics
        self._prompt_counted = False

    @property
    def done(self) -> bool:
        return self.outcome is not None

    def on_event(self, event: GenerationEvent) -> None:
        """Record a worker event as it reaches the event loop."""
        if isinstance(event, TokenEvent):
            self.num_drafted, self.num_draft_accepted = event.drafts
            self.on_token()
        elif isinstance(event, AdmittedEvent):
            self.on_admitted(event.cached_tokens)
        elif isinstance(event, CompleteEvent):
            self.num_drafted, self.num_draft_accepted = event.drafted, event.accepted
            self.on_finished(event.finish_reason)
        elif isinstance(event, ErrorEvent):
            self.on_failed(event.error)

    def on_refused(self, error: Exception) -> None:
        """Submitting raised ``error``: the request never ran."""
        self.on_rejected(rejection_reason(error) or str(getattr(error, "kind", "error")),
                         _status_of(error))

    def on_admitted(self, cached_tokens: int) -> None:
        """The request got a lane (it restores ``cached_tokens`` prompt tokens)."""
        if self.done or self.admitted_at is not None:
            return
        metrics = self._metrics
        self.admitted_at = metrics.clock()
        self.num_cached_tokens = cached_tokens
        metrics.queue.add(self.admitted_at - self.submitted_at)

    def on_token(self) -> None:
        """A generated token arrived."""
        if self.done:
            return
        metrics = self._metrics
        now = metrics.clock()
        if self.first_token_at is None:
            self.first_token_at = now
            metrics.ttft.add(now - self.submitted_at, now)
            self._count_prompt()
        else:
            metrics.itl.add(now - (self.last_token_at or now), now)
        self.last_token_at = now
        self.num_generated_tokens += 1
        metrics.num_generated_tokens += 1
        metrics.generated.add(1, now)

    def on_finished(self, reason: str) -> None:
        """The generation ended normally (``"stop"`` or ``"length"``)."""
        if self._end(reason, 200):
            self._count_prompt()
            self._metrics.e2e.add(self._metrics.clock() - self.submitted_at)
            self._metrics.count_outcome("finished", reason)

    def on_failed(self, error: Exception) -> None:
        """The worker reported an error; a full waiting queue counts as a rejection."""
        kind = rejection_reason(error)
        if kind is not None:
            self.on_rejected(kind, _status_of(error))
        elif self._end("failed", _status_of(error)):
            self._metrics.count_outcome("failed")

    def on_cancelled(self) -> None:
        """The client went away (or the handler failed) before the end."""
        if self._end("cancelled", CLIENT_CLOSED):
            self._metrics.count_outcome("cancelled")

    def on_rejected(self, reason: str, status: int = 429) -> None:
        """The request was refused before it ran (queue full, stopped...)."""
        if self._end("rejected", status):
            self._metrics.record_rejection(reason)

    def _end(self, outcome: str, status: int) -> bool:
        if self.done:
            return False
        self.outcome, self.status, self.ended_at = outcome, status, self._metrics.clock()
        self._metrics.untrack(self)
        return True

    def _count_prompt(self) -> None:
        if not self._prompt_counted:
            self._prompt_counted = True
            self._metrics.num_prompt_tokens += self.num_prompt_tokens
            self._metrics.prompt.add(self.num_prompt_tokens)


def _status_of(error: Exception) -> int:
    status = getattr(error, "status", None)
    return status if isinstance(status, int) and 400 <= status <= 599 else 500


def rejection_reason(error: Exception) -> str | None:
    """The rejection label of a worker error, or None when it is a real failure."""
    kind = getattr(error, "kind", None)
    if getattr(error, "status", None) == 429:
        return "queue_full"
    if kind == "stopped":
        return "unavailable"
    if kind == "invalid_request":
        return "invalid"
    return None
