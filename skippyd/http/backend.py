"""The boundary between the HTTP layer and whatever serves generations.

The OpenAI app codes against :class:`ServingBackend` only; the daemon implements it over
the llama.cpp runtime and the worker, tests with a scripted fake.
Generation requests and events are the worker's own types
(:mod:`skippyd.engine.worker.generation_events`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol, runtime_checkable

from skippyd.engine.worker.generation_events import GenerationEvent, GenerationRequest

logger = logging.getLogger(__name__)

HealthStatus = Literal["loading", "ok", "failed", "draining", "degraded"]


@runtime_checkable
class Detokenizer(Protocol):
    """Turns one generation's tokens into text, one token at a time.

    Text comes out UTF-8 safe: bytes of an incomplete character are held until the
    token that completes it. Control tokens (end-of-turn and the like) render as "".
    """

    def feed(self, token: int) -> str:
        """Return the text that ``token`` completes (possibly "")."""
        ...

    def flush(self) -> str:
        """Return whatever is still held at the end of generation."""
        ...


@runtime_checkable
class ServingBackend(Protocol):
    """What the OpenAI app needs from the serving side.

    ``tokenize``, ``render_chat``, ``chat_tokens``, ``detokenize``, ``check_grammar``
    and ``schema_grammar`` run in a thread pool (several at once: they must be
    thread-safe); every other method is called on the event-loop thread and must not
    block. ``submit``'s ``on_event`` is called on the worker thread.
    """

    model_id: str
    """The name reported in ``/v1/models`` and in every response's ``model``."""
    n_vocab: int
    """Vocabulary size; token ids in prompts and ``logit_bias`` must be below it."""

    @property
    def max_context_tokens(self) -> int:
        """Context limit of one sequence, in tokens (prompt + completion): what a request's
        budget is clamped against."""
        ...

    @property
    def local_sampling(self) -> bool:
        """Tokens are sampled in this process, so grammars and log-probabilities are
        available (not on a split pipeline, whose final stage samples)."""
        ...

    @property
    def chat_template(self) -> str | None:
        """The chat template in use (the model's, or the configured override)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Facts for ``/props`` and ``/v1/models``: ``lane_count``, ``layer_start``,
        ``layer_end``, ``n_layer``, ``model_path``, ``bos_token``, ``eos_token``."""
        ...

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = False) -> list[int]:
        """Tokenize raw text; ``add_special`` adds BOS (and EOS) as the model wants, and
        ``parse_special`` turns the text of control tokens into those tokens."""
        ...

    def render_chat(self, messages: list[dict[str, Any]], *,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """Apply the chat template, with the generation prompt appended unless told not to.

        Raises:
            ValueError: The messages do not fit the template (e.g. bad role order).
        """
        ...

    def chat_tokens(self, messages: list[dict[str, Any]], *,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
        """Render the chat with the model's template and tokenize it.

        Only the template's own text may produce control tokens: message content is
        tokenized as plain text unless the operator allowed otherwise. The backend
        also knows whether the template already emitted BOS.

        Returns:
            The prompt tokens and the rendered text.

        Raises:
            ValueError: The messages do not fit the template, or the content cannot be
                kept apart from the template's markup.
        """
        ...

    def detokenizer(self) -> Detokenizer:
        """Return a fresh detokenizer for one generation."""
        ...

    def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens`` (``/detokenize``)."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token's piece (log-probability entries carry them)."""
        ...

    def check_grammar(self, grammar: str) -> None:
        """Check a GBNF grammar against the vocabulary before a request is queued.

        Raises:
            ValueError: llama.cpp cannot parse it (HTTP 400).
        """
        ...

    def schema_grammar(self, schema: dict[str, Any], root: str | None = None) -> str:
        """The checked GBNF grammar of a JSON schema (``response_format``, tools).

        Raises:
            ValueError: The schema cannot be turned into a grammar (HTTP 400).
        """
        ...

    def arriving(self) -> AbstractContextManager[None]:
        """Held while a request is read, parsed and tokenized, before it is submitted: a
        worker starting from idle waits a moment for requests that arrive together."""
        ...

    def submit(
        self, request: GenerationRequest, on_event: Callable[[GenerationEvent], None]
    ) -> None:
        """Queue a generation; events arrive through ``on_event`` on the worker thread.

        Raises:
            QueueFullError: The generation queue is full (HTTP 429).
            WorkerStoppedError: The worker is gone or draining (HTTP 503).
        """
        ...

    def cancel(self, request_id: str) -> None:
        """Abandon a generation and free its lane. Idempotent; never raises."""
        ...

    def health(self) -> tuple[HealthStatus, str | None]:
        """Return the serving state and, when not ``"ok"``, a reason (or None)."""
        ...

