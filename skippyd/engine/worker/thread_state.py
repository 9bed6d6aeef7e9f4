"""What the worker thread keeps per admitted generation, and how it reads the acks."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from skippyd.engine.worker.commands import (
    AckSlot,
    GenerationEvent,
    GenerationRequest,
    TokenControl,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestState:
    """What the worker keeps per admitted generation."""

    request: GenerationRequest
    on_event: Callable[[GenerationEvent], None]
    runtime_configured: bool
    num_generated: int
    pending_controls: deque[AckSlot] = field(default_factory=deque)
    saw_eog: bool = False

    def emit(self, event: GenerationEvent) -> bool:
        """Deliver an event; False if the consumer's callback failed (it is gone)."""
        try:
            self.on_event(event)
        except Exception:
            logger.exception("event callback of %s failed", self.request.request_id)
            return False
        return True

    def finish_reason(self) -> str:
        if not self.saw_eog and self.num_generated >= self.request.max_tokens:
            return "length"
        return "stop"


def consumer_stopped(state: RequestState) -> bool:
    """Pop answered Continue acks; True once the oldest answered ack says Stop.

    A consumer that vanished without answering counts as Stop: nobody reads on.
    """
    while state.pending_controls:
        control = state.pending_controls[0].control
        if control is None:
            return False  # not answered yet: never block the iteration on it
        if control is TokenControl.DISCONNECTED:
            logger.info("the consumer of %s went away without answering; stopping it",
                        state.request.request_id)
            return True
        if control is TokenControl.STOP:
            return True
        state.pending_controls.popleft()
    return False
