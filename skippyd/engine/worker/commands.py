"""The commands other threads send to the worker through its bounded queue.

Direct iterations (:class:`~skippyd.engine.worker.direct_batch.DirectIteration`) are
commands too; they live with the batching that runs them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from skippyd.engine.worker.generation_events import FinalEvent, GenerationEvent, GenerationRequest

if TYPE_CHECKING:
    from skippyd.engine.runtime.contract import Runtime

logger = logging.getLogger(__name__)

#: How long the worker waits for a command when nothing it holds can run.
IDLE_POLL_INTERVAL_S = 0.010


@dataclass(slots=True)
class SubmitCommand:
    request: GenerationRequest
    on_event: Callable[[GenerationEvent], None]
    answered: bool = False
    """Set once the generation's final event went out (the worker thread only)."""

    def answer(self, event: FinalEvent) -> None:
        """Send the generation's final event, unless it already has one."""
        if self.answered:
            return
        self.answered = True
        try:
            self.on_event(event)
        except Exception:  # the consumer's bug must not reach the worker
            logger.exception("event callback of %s failed", self.request.request_id)


@dataclass(slots=True)
class CancelCommand:
    req_id: str
    overflowed: bool = False
    """It found the command queue full and went to the worker's inbox instead, so it
    may overtake the Submit it cancels."""


@dataclass(slots=True)
class DropSessionCommand:
    """Free a runtime session a later stage of a split pipeline no longer needs."""

    session_id: str


@dataclass(slots=True)
class RuntimeOperation:
    """A closure ``fn(runtime)`` to run on the worker thread, in command order.

    Nobody waits for its result: the worker logs what it raises.
    """

    label: str
    fn: Callable[[Runtime], Any]


class ShutdownCommand:
    """Stop the worker; everything still held fails with "iteration scheduler stopped"."""
