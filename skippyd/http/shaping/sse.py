"""Response shapes of the OpenAI API and the server-sent-events response.

:class:`ResponseShape` builds the JSON objects of one response (streamed chunks, the
final usage chunk, or the whole non-streaming body) for either endpoint, so both
endpoints share one generation loop. :class:`EventStreamResponse` sends ``data:``
events and always runs its close hook, whether the stream ends, fails, or the client
goes away.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
#: An SSE comment: keeps a quiet stream (a long prompt being prefilled) alive through
#: proxies and client read timeouts; clients ignore it.
SSE_KEEP_ALIVE = b": keep-alive\n\n"
#: Stands in for a chunk's text while its encoded bytes are split around it.
_TEXT_MARK = "\x00skippyd-text\x00"
#: ``json.dumps(text, ensure_ascii=False)`` for a str, without building an encoder per call.
_json_string = json.encoder.encode_basestring


def sse_event(payload: dict[str, Any]) -> bytes:
    """Encode one ``data:`` event."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               clamp: tuple[int, int] | None = None,
               drafts: tuple[int, int] | None = None) -> dict[str, Any]:
    """Build the ``usage`` object.

    Args:
        prompt_tokens: Prompt length (counted once, whatever ``n``).
        completion_tokens: Generated tokens of every choice.
        cached_tokens: Prompt tokens served from the prefix cache.
        clamp: (requested, granted) when ``max_tokens`` was clamped to what fits.
        drafts: (drafted, accepted) tokens of speculative decoding, when it drafted: in
            OpenAI's names for predicted tokens (``completion_tokens_details``).
    """
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if clamp is not None:
        usage["max_tokens_clamped"] = {"requested": clamp[0], "granted": clamp[1]}
    if drafts is not None:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": drafts[1],
                                              "rejected_prediction_tokens": drafts[0] - drafts[1]}
    return usage


def add_timings(body: dict[str, Any], drafts: tuple[int, int] | None) -> dict[str, Any]:
    """``body`` with llama-server's ``timings`` of speculative decoding, when it drafted."""
    if drafts is not None:
        body["timings"] = {"draft_n": drafts[0], "draft_n_accepted": drafts[1]}
    return body


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """The identity of one response and the builders of its JSON objects."""

    kind: Literal["chat", "completion"]
    response_id: str
    """``chatcmpl-…`` or ``cmpl-…``."""
    created: int
    """Unix time in seconds."""
    model: str
    usage_in_chunks: bool = False
    """``stream_options.include_usage``: every chunk carries ``usage`` (null until the end)."""
    _text_event_parts: tuple[bytes, bytes] = field(init=False, repr=False, compare=False)
    """The encoded text chunk before and after its text (see :meth:`text_event`)."""

    def __post_init__(self) -> None:
        encoded = sse_event(self.text_chunk(_TEXT_MARK))
        before, _, after = encoded.partition(json.dumps(_TEXT_MARK).encode("utf-8"))
        object.__setattr__(self, "_text_event_parts", (before, after))

    def text_event(self, text: str) -> bytes:
        """``sse_event(self.text_chunk(text))`` for non-empty ``text``, without building
        the chunk: the bytes around the text are the same for every token."""
        before, after = self._text_event_parts
        return before + _json_string(text).encode("utf-8") + after

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
        }

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(name)
        body["choices"] = [choice]
        if self.usage_in_chunks:
            body["usage"] = None
        return body

    def first_chunk(self, index: int = 0) -> dict[str, Any] | None:
        """The opening chunk of choice ``index`` (chat announces the assistant role), or None."""
        if self.kind != "chat":
            return None
        delta = {"role": "assistant", "content": ""}
        return self._chunk({"index": index, "delta": delta, "logprobs": None,
                            "finish_reason": None})

    def text_chunk(self, text: str, finish_reason: str | None = None, *, index: int = 0,
                   logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A chunk carrying generated text and, on the last one, the finish reason."""
        if self.kind == "chat":
            return self.delta_chunk({"content": text} if text else {}, finish_reason,
                                    index=index, logprobs=logprobs)
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return self._chunk(choice)

    def delta_chunk(self, delta: dict[str, Any], finish_reason: str | None = None, *,
                    index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A chat chunk with any delta: ``content``, ``reasoning_content``, ``tool_calls``."""
        return self._chunk({"index": index, "delta": delta, "logprobs": logprobs,
                            "finish_reason": finish_reason})

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The final ``include_usage`` chunk: no choices, just usage."""
        body = self._chunk({})
        body["choices"] = []
        body["usage"] = usage
        return body

    def full_body(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        """The whole non-streaming response of one plain-text choice."""
        if self.kind == "chat":
            choice = self.chat_choice(0, {"role": "assistant", "content": text}, finish_reason)
        else:
            choice = self.completion_choice(0, text, finish_reason)
        return self.full_body_choices([choice], usage)

    def full_body_choices(self, choices: list[dict[str, Any]],
                          usage: dict[str, Any]) -> dict[str, Any]:
        """The whole non-streaming response of built choices."""
        body = self._envelope("chat.completion" if self.kind == "chat" else "text_completion")
        body["choices"] = choices
        body["usage"] = usage
        return body

    @staticmethod
    def chat_choice(index: int, message: dict[str, Any], finish_reason: str,
                    logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """One choice of a non-streaming chat response."""
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": finish_reason}

    @staticmethod
    def completion_choice(index: int, text: str, finish_reason: str,
                          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """One choice of a non-streaming completions response."""
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}


class EventStreamResponse(Response):
    """A ``text/event-stream`` response that notices a client going away.

    A watcher task waits for ``http.disconnect`` and cancels the stream, so a client
    that leaves while the generation is quiet is noticed at once, not at the next write.
    ``on_close`` runs exactly once in every case; it must not block.

    Args:
        events: Encoded events to send, in order.
        on_close: Synchronous clean-up hook (cancels the generation if unfinished).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.status_code = 200
        self.background = None
        self._events = events
        self._on_close = on_close
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._watch_disconnect, receive, group.cancel_scope)
                await self._send_events(send)
                group.cancel_scope.cancel()
        except* OSError as group:
            # A server reporting the disconnect through a failed write (ASGI spec 2.4).
            logger.debug("client went away mid-stream: %s", group.exceptions[0])
        finally:
            try:
                self._on_close()
            finally:
                with anyio.CancelScope(shield=True):
                    await _aclose(self._events)

    async def _send_events(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for event in self._events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                logger.debug("client disconnected; cancelling the stream")
                scope.cancel()
                return


async def _aclose(events: AsyncIterator[bytes]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()
