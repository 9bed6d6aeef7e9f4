"""One generation seen from the HTTP side: worker events in, safe text pieces out.

The worker calls ``on_event`` on its own thread; events reach the event loop through the
loop's :class:`~skippyd.http.event_relay.EventRelay` (one wake-up for every token of an
iteration) and are handled there at once: detokenized, checked against the stop
strings and the budget, and acknowledged exactly once — ``STOP`` when a stop string
matched or the HTTP-side budget ran out (so the worker frees the lane at once),
``CONTINUE`` otherwise. The response coroutine then takes the text that piled up since
it last looked (:meth:`GenerationStream.next_pieces`), so a slow client costs one write
per wake-up, not one per token. Closing an unfinished stream cancels the sequence and
stops every token still in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from skippyd.engine.runtime.contract import SamplingConfig, TokenLogprob
from skippyd.engine.worker.generation_events import (
    AdmittedEvent,
    CompleteEvent,
    ErrorEvent,
    GenerationEvent,
    GenerationRequest,
    PromptLogprobsEvent,
    TokenControl,
    TokenEvent,
)
from skippyd.engine.worker.worker_errors import QueueFullError, WorkerError
from skippyd.http.api_errors import ApiError
from skippyd.http.backend import ServingBackend
from skippyd.http.event_relay import EventRelay, relay_for
from skippyd.http.parsing.request_params import GenerationParams
from skippyd.http.shaping.stops import StopMatcher

if TYPE_CHECKING:
    from skippyd.http.observability.metrics import ServingMetrics

logger = logging.getLogger(__name__)


def _resolve(waiter: asyncio.Future[bool], woken: bool) -> None:
    if not waiter.done():
        waiter.set_result(woken)


def api_error_from(error: WorkerError) -> ApiError:
    """Map a worker error to the HTTP error it suggests (429 gets ``Retry-After``)."""
    headers = {}
    if error.retry_after_s is not None or isinstance(error, QueueFullError):
        headers["Retry-After"] = str(max(1, round(error.retry_after_s or 1)))
    status = error.status if 400 <= error.status <= 599 else 500
    return ApiError(status, error.message, code=error.kind, headers=headers)


class GenerationStream:
    """Drives one submitted generation and yields its text.

    Args:
        backend: The serving backend.
        request_id: Unique id, also used as the response id.
        prompt_tokens: The tokenized prompt.
        max_tokens: Completion budget (already checked against the context).
        params: Parsed request parameters (sampling, stops).
        metrics: Where the request's lifecycle is recorded, if anywhere.
        sampling: Sampling of this generation, when not ``params.sampling`` (one choice of
            several, a grammar, log-probabilities).
        fork_of: The first choice's id, for the later choices of an ``n > 1`` request.
    """

    def __init__(
        self,
        backend: ServingBackend,
        request_id: str,
        prompt_tokens: list[int],
        max_tokens: int,
        params: GenerationParams,
        metrics: ServingMetrics | None = None,
        *,
        sampling: SamplingConfig | None = None,
        fork_of: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_tokens)
        self.num_completion_tokens = 0
        self.finish_reason: str | None = None
        """``"stop"`` or ``"length"`` once finished (``"error"`` after an error)."""
        self.prompt_logprobs: dict[int, TokenLogprob] = {}
        """Log-probabilities of prompt tokens by position (when the sampling asks)."""
        self.num_cached_tokens = 0
        self.num_drafted = 0
        """Drafted tokens verified for it (speculative decoding), once it completed."""
        self.num_accepted = 0
        """Prompt tokens restored from the prefix cache (known once admitted)."""
        self.prompt_done = asyncio.Event()
        """Set once the prompt is computed (first token) or the generation ended."""
        self._new_logprobs: list[TokenLogprob] = []
        self._backend = backend
        self._request = GenerationRequest(
            request_id=request_id,
            prompt_tokens=list(prompt_tokens),
            max_tokens=max_tokens,
            sampling=params.sampling if sampling is None else sampling,
            fork_of=fork_of,
            speculative=params.speculative,
        )
        self._stops = StopMatcher(params.stop)
        self._detokenizer = backend.detokenizer()
        # NOTE: unbounded, but the worker sends at most max_tokens tokens plus one
        # terminal event per request, so its length is bounded by the request.
        self._pieces: list[str] = []
        self._error: ApiError | None = None
        self._waiter: asyncio.Future[bool] | None = None
        self._relay: EventRelay | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._submitted = False
        self._settled = False
        self._closed = False
        self._timer = (None if metrics is None
                       else metrics.start_request(request_id, len(prompt_tokens)))

    @property
    def finished(self) -> bool:
        """True once the generation ended (normally or with an error)."""
        return self.finish_reason is not None

    def start(self) -> None:
        """Submit the generation. Call on the event loop thread.

        Raises:
            ApiError: 429 with ``Retry-After`` when the queue is full, 503 when the
                worker is stopped, or the status the worker suggests.
        """
        # NOTE: kept, because asyncio.get_running_loop() makes a getpid() system call.
        self._loop = asyncio.get_running_loop()
        self._relay = relay_for(self._loop)
        try:
            self._backend.submit(self._request, self._on_event)
        except WorkerError as exc:
            logger.info("submit of %s refused: %s", self.request_id, exc.kind)
            if self._timer is not None:
                self._timer.on_refused(exc)
            raise api_error_from(exc) from exc
        self._submitted = True
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("submitted %s", self._request.anon_repr())

    async def next_pieces(self, timeout_s: float | None = None) -> list[str] | None:
        """Wait for text and return every piece produced since the last call.

        Returns an empty list once the generation has finished and all of its text was
        taken, and None when ``timeout_s`` passed without anything new (a streaming
        response then sends a keep-alive comment).

        Raises:
            ApiError: The worker reported an error for this request.
        """
        if not self._pieces and self._error is None and not self.finished:
            # NOTE: one future and one timer per wait, resolved by _deliver (True) or by
            # the timer (False); wait_for over a shield cost four callbacks per token.
            loop = self._loop or asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = (None if timeout_s is None
                     else loop.call_later(timeout_s, _resolve, waiter, False))
            try:
                woken = await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if not woken:
                return None
        pieces, self._pieces = self._pieces, []
        if not pieces and self._error is not None:
            raise self._error
        return pieces

    async def pieces(self) -> AsyncIterator[str]:
        """Yield non-empty text pieces until the generation finishes.

        Raises:
            ApiError: The worker reported an error for this request.
        """
        while True:
            batch = await self.next_pieces()
            if not batch:
                if self.finished:
                    return
                continue
            for piece in batch:
                yield piece

    async def collect(self) -> str:
        """Return the whole generated text (non-streaming responses)."""
        return "".join([piece async for piece in self.pieces()])

    def take_logprobs(self) -> list[TokenLogprob]:
        """Log-probabilities of the tokens received since the last call, in order."""
        taken, self._new_logprobs = self._new_logprobs, []
        return taken

    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (0 until admitted)."""
        return self.num_cached_tokens

    def close(self) -> None:
        """Release the generation. Idempotent; safe at any point after construction.

        An unfinished generation (client gone, error in the handler) is cancelled; token
        events still on their way are answered ``STOP`` when they arrive.
        """
        if self._closed:
            return
        self._closed = True
        self.prompt_done.set()
        if self._submitted and not self._settled:
            logger.info("cancelling unfinished generation %s", self.request_id)
            self._backend.cancel(self.request_id)
            if self._timer is not None:
                self._timer.on_cancelled()

    # -- worker thread -----------------------------------------------------------------

    def _on_event(self, event: GenerationEvent) -> None:
        assert self._relay is not None, "events before start()"
        try:
            self._relay.post(self._deliver, event)
        except RuntimeError:
            # The loop is closed (server shut down): nobody will read this token.
            self._stop_if_token(event)

    # -- event loop thread -------------------------------------------------------------

    def _deliver(self, event: GenerationEvent) -> None:
        if self._closed or self.finished:
            self._stop_if_token(event)
            return
        if self._timer is not None:
            self._timer.on_event(event)
        try:
            text = self._handle(event)
        except ApiError as exc:
            self._error = exc
        else:
            if text:
                self._pieces.append(text)
        if self._waiter is not None:
            _resolve(self._waiter, True)

    @staticmethod
    def _stop_if_token(event: GenerationEvent) -> None:
        if isinstance(event, TokenEvent):
            event.ack.send(TokenControl.STOP)

    def _handle(self, event: GenerationEvent) -> str:
        if isinstance(event, AdmittedEvent):
            self.num_cached_tokens = event.cached_tokens
            return ""
        if isinstance(event, PromptLogprobsEvent):
            for position, entry in event.entries:  # a replayed prompt reports again
                self.prompt_logprobs.setdefault(position, entry)
            return ""
        self.prompt_done.set()
        if isinstance(event, TokenEvent):
            return self._handle_token(event)
        self._settled = True
        if isinstance(event, CompleteEvent):
            self.num_drafted, self.num_accepted = event.drafted, event.accepted
            text = self._drain_text()
            self.finish_reason = self.finish_reason or event.finish_reason
            return text
        if isinstance(event, ErrorEvent):
            self.finish_reason = "error"
            logger.warning("generation %s failed: %s", self.request_id, event.error.kind)
            raise api_error_from(event.error)
        raise RuntimeError(f"unexpected scheduler event {type(event).__name__}")

    def _handle_token(self, event: TokenEvent) -> str:
        self.num_completion_tokens += 1
        self.num_drafted, self.num_accepted = event.drafts
        if event.logprob is not None:
            self._new_logprobs.append(event.logprob)
        step = self._stops.push(self._detokenizer.feed(event.token))
        if step.stopped:
            self._finish_early("stop", event)
            return step.text
        if self.num_completion_tokens >= self._request.max_tokens:
            self._finish_early("length", event)
            return step.text + self._drain_text()
        event.ack.send(TokenControl.CONTINUE)
        return step.text

    def _finish_early(self, reason: str, event: TokenEvent) -> None:
        # NOTE: STOP frees the lane within one iteration; no cancel is needed after it.
        event.ack.send(TokenControl.STOP)
        self._settled = True
        self.finish_reason = reason
        if self._timer is not None:
            self._timer.on_finished(reason)

    def _drain_text(self) -> str:
        """Release what the detokenizer and the stop matcher still hold."""
        step = self._stops.push(self._detokenizer.flush())
        if step.stopped:
            self.finish_reason = "stop"
            return step.text
        return step.text + self._stops.flush()
