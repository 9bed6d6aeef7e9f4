"""One record per generation on the worker thread: its state and everything it holds.

A :class:`Generation` lives from the moment the worker takes its ``Submit`` off the queue
until it has sent its one final event, and holds by reference all the generation owns
(the policy's ``ScheduledSequence`` itself, its prefix-cache lease and parking, its
sibling choices, its session, its unanswered acks): nothing else keeps a per-request map,
so nothing has to be kept in step by hand. Its :class:`GenerationStatus` moves only along
:data:`TRANSITIONS`, and every status may end in FINISHED; ``docs/scheduler.md``, *One
record per generation*, has the status table.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from skippyd.engine.worker.commands import SubmitCommand
from skippyd.engine.worker.generation_events import (
    AckSlot,
    FinalEvent,
    GenerationEvent,
    GenerationRequest,
    TokenControl,
)

if TYPE_CHECKING:
    from skippyd.engine.policy import ScheduledSequence
    from skippyd.engine.prefix_cache import Lease
    from skippyd.engine.worker.drafting import RequestDrafts

logger = logging.getLogger(__name__)


class GenerationStatus(enum.Enum):
    """Where a generation is in its life."""

    NEW = "new"
    """Taken off the queue, not yet routed."""
    WAITING = "waiting"
    """In the policy's waiting queue, never admitted yet."""
    PARKED = "parked"
    """Outside the policy until the request it is parked behind has computed the
    longer prefix they share (then it restores that prefix from the cache)."""
    AWAITING_PROMPT = "awaiting_prompt"
    """A later choice of an ``n > 1`` request, outside the policy until the first choice
    has computed their common prompt (then it copies that prompt's KV)."""
    PREFILLING = "prefilling"
    """Admitted: computing its prompt (or, after a preemption, its prompt and tokens)."""
    DECODING = "decoding"
    """Admitted: generating tokens."""
    PREEMPTED = "preempted"
    """Back in the policy's waiting queue after a preemption; recomputes when admitted."""
    FINISHED = "finished"
    """Its final event went out; it holds nothing any more."""


_S = GenerationStatus
#: Every status a status may move to (FINISHED is reachable from each one).
TRANSITIONS: dict[GenerationStatus, frozenset[GenerationStatus]] = {
    _S.NEW: frozenset({_S.WAITING, _S.PARKED, _S.AWAITING_PROMPT}),
    _S.PARKED: frozenset({_S.WAITING, _S.PARKED}),
    _S.AWAITING_PROMPT: frozenset({_S.WAITING, _S.PARKED}),
    _S.WAITING: frozenset({_S.PREFILLING}),
    _S.PREFILLING: frozenset({_S.DECODING, _S.PREEMPTED}),
    _S.DECODING: frozenset({_S.PREEMPTED}),
    _S.PREEMPTED: frozenset({_S.PREFILLING}),
    _S.FINISHED: frozenset(),
}
#: Statuses of a generation that waits for a lane and has never had one.
NOT_ADMITTED = frozenset({_S.NEW, _S.WAITING, _S.PARKED, _S.AWAITING_PROMPT})


@dataclass(eq=False, slots=True)
class Generation:
    """What the worker keeps of one generation; see the module docstring."""

    command: SubmitCommand
    """The Submit it came from: its request and its consumer."""
    submitted_at: float
    """Worker clock when the Submit was taken off the queue."""
    status: GenerationStatus = GenerationStatus.NEW
    sequence: ScheduledSequence | None = None
    """The policy's sequence, once it entered the policy (the same object)."""
    lease: Lease | None = None
    """Its claim on a prefix-cache entry, from lookup until it leaves."""
    cached_tokens: int = 0
    """Prompt tokens it restores from the prefix cache."""
    parked_behind: Generation | None = None
    """While PARKED: the in-flight request computing the prefix it waits for."""
    park_point: int = 0
    """While PARKED: tokens ``parked_behind``'s KV must hold before it is recorded."""
    shared_records: int = 0
    """Shared-prefix records taken from this request's KV for requests parked behind it."""
    first_choice: Generation | None = None
    """For a later choice of ``n``: the first choice, whose prompt it copies."""
    later_choices: list[Generation] = field(default_factory=list)
    """For a first choice: its later choices, waiting or released."""
    fork_tokens: int = 0
    """For a released later choice: prompt tokens to copy from a sibling into its lane."""
    has_session: bool = False
    """It holds a runtime session (a lane and its KV)."""
    pending_acks: deque[AckSlot] = field(default_factory=deque)
    """Acknowledgements of its token events, oldest first, until answered."""
    num_generated: int = 0
    saw_eog: bool = False
    admitted_at: float | None = None
    """Worker clock at its first admission."""
    progressed_at: float = 0.0
    """Worker clock at its last progress (admission, a prompt chunk, a token)."""
    drafts: RequestDrafts | None = None
    """Its speculative decoding record, when it speculates."""

    @property
    def id(self) -> str:
        return self.command.request.request_id

    @property
    def request(self) -> GenerationRequest:
        return self.command.request

    @property
    def prompt(self) -> tuple[int, ...]:
        return tuple(self.command.request.prompt_tokens)

    @property
    def finished(self) -> bool:
        return self.status is GenerationStatus.FINISHED

    def move_to(self, status: GenerationStatus) -> None:
        """Change status along an edge of :data:`TRANSITIONS`.

        Raises:
            RuntimeError: The move is not an edge (a worker bug).
        """
        if status is not GenerationStatus.FINISHED and status not in TRANSITIONS[self.status]:
            raise RuntimeError(f"generation {self.id}: no move from {self.status.value} "
                               f"to {status.value}")
        self.status = status

    def emit(self, event: GenerationEvent) -> bool:
        """Deliver a non-final event; False if the consumer's callback failed (it is gone)."""
        try:
            self.command.on_event(event)
        except Exception:
            logger.exception("event callback of %s failed", self.id)
            return False
        return True

    def end(self, event: FinalEvent) -> None:
        """Mark it FINISHED and send its final event (the first call only)."""
        self.status = GenerationStatus.FINISHED
        self.command.answer(event)

    def finish_reason(self) -> str:
        if not self.saw_eog and self.num_generated >= self.request.max_tokens:
            return "length"
        return "stop"

    def consumer_stopped(self) -> bool:
        """Pop answered Continue acks; True once the oldest answered ack says Stop.

        A consumer that vanished without answering counts as Stop: nobody reads on.
        """
        acks = self.pending_acks
        while acks:
            control = acks[0].control
            if control is None:
                return False  # not answered yet: never block the iteration on it
            if control is TokenControl.DISCONNECTED:
                logger.info("the consumer of %s went away without answering; stopping it",
                            self.id)
                return True
            if control is TokenControl.STOP:
                return True
            acks.popleft()
        return False
