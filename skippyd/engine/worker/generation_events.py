"""A generation as its caller sees it: the request, the events it receives, its acks.

The worker calls a generation's ``on_event`` once per event on its own thread; a
streaming consumer answers each token through a :class:`TokenAck`.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from skippyd.engine.runtime.contract import SamplingConfig, TokenLogprob
from skippyd.engine.worker.worker_errors import WorkerError


@dataclass(slots=True)
class GenerationRequest:
    """A planned generation submitted by a client."""

    request_id: str
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingConfig | None = None
    fork_of: str | None = None
    """The ``request_id`` of another generation with the same prompt, submitted just
    before this one (the first of ``n`` choices): this one copies that generation's
    prompt KV once it is computed instead of computing it again."""
    speculative: bool = True
    """Whether its decoding may carry drafts when the stage speculates (False: never)."""

    def anon_repr(self) -> str:
        """Describe the request without its tokens (never log prompt text)."""
        return (
            f"GenerationRequest(id={self.request_id!r}, prompt_tokens={len(self.prompt_tokens)}, "
            f"max_tokens={self.max_tokens}, fork_of={self.fork_of!r})"
        )


class TokenControl(enum.Enum):
    """A consumer's answer to one token event."""

    CONTINUE = "continue"
    STOP = "stop"
    DISCONNECTED = "disconnected"
    """Never sent: the channel records it when the consumer dropped the event unanswered."""


class AckSlot:
    """The worker's end of a :class:`TokenAck`: where the answer lands.

    The worker keeps only this, never the :class:`TokenAck` itself, so the ack lives
    exactly as long as the consumer holds the event.
    """

    __slots__ = ("control",)

    def __init__(self) -> None:
        self.control: TokenControl | None = None


class TokenAck:
    """One-slot acknowledgement channel for a token event.

    The consumer calls :meth:`send` once from any thread; the worker polls the
    :attr:`slot` without blocking. A consumer that vanishes (drops the event, or dies
    holding it) without answering leaves :attr:`TokenControl.DISCONNECTED` behind, which
    the worker treats as a stop: nobody reads the rest.
    """

    __slots__ = ("slot", "_lock")

    def __init__(self) -> None:
        self.slot = AckSlot()
        self._lock = threading.Lock()

    def send(self, control: TokenControl) -> bool:
        """Answer the token; returns False (and changes nothing) if already answered.

        Raises:
            TypeError: ``control`` is not a :class:`TokenControl`.
        """
        if not isinstance(control, TokenControl):
            raise TypeError(f"control: expected TokenControl, got {type(control).__name__}")
        with self._lock:
            if self.slot.control is not None:
                return False
            self.slot.control = control
            return True

    def poll(self) -> TokenControl | None:
        """The answer, or None while the consumer has not answered."""
        return self.slot.control

    def __del__(self) -> None:
        # The last reference is gone, so no send() can race this.
        if self.slot.control is None:
            self.slot.control = TokenControl.DISCONNECTED


@dataclass(frozen=True, slots=True)
class AdmittedEvent:
    """The request got a lane: its prompt is computed from now on (sent once)."""

    cached_tokens: int
    """Leading prompt tokens restored from the prefix cache instead of computed."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A generated token; the consumer must answer ``ack`` exactly once."""

    token: int
    ack: TokenAck
    logprob: TokenLogprob | None = None
    """The token's log-probability, when the request's sampling asks for it."""
    drafts: tuple[int, int] = (0, 0)
    """(drafted, accepted) tokens of its speculative decoding so far, so a consumer that
    ends the request itself (a stop string, its own ``max_tokens``) still knows them."""


@dataclass(frozen=True, slots=True)
class PromptLogprobsEvent:
    """Log-probabilities of prompt tokens just computed (``prompt_logprobs`` requests).

    A prompt computed again (after a preemption) reports its positions again.
    """

    entries: tuple[tuple[int, TokenLogprob], ...]
    """(KV position, log-probability) of prompt tokens, in position order."""


@dataclass(frozen=True, slots=True)
class CompleteEvent:
    """The generation ended normally."""

    finish_reason: str
    """``"stop"`` (end of generation or consumer Stop) or ``"length"`` (max_tokens)."""
    drafted: int = 0
    """Drafted tokens its decoding verified (speculative decoding)."""
    accepted: int = 0
    """How many of them were accepted."""


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """The generation failed or was cancelled; no further events follow."""

    error: WorkerError


FinalEvent = CompleteEvent | ErrorEvent
"""The one event that ends every generation."""
GenerationEvent = AdmittedEvent | TokenEvent | PromptLogprobsEvent | FinalEvent
