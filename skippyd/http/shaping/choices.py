"""The choices of one response: running them, shaping their text, building the JSON.

A request with ``n`` choices submits ``n`` generations; the first computes the prompt
and the others copy it (``fork_of``). Each :class:`Choice` turns its generation's text
into what the API returns: reasoning, content and tool calls for chat, the echoed prompt
for completions, and log-probabilities in either endpoint's shape. Streamed, the choices'
chunks are interleaved as they come; otherwise each choice is collected whole.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from skippyd.http.api_errors import ApiError
from skippyd.http.backend import ServingBackend
from skippyd.http.parsing.tools import ToolFormat, ToolSpec
from skippyd.http.shaping.generation import GenerationStream
from skippyd.http.shaping.logprobs import chat_logprobs, completion_logprobs
from skippyd.http.shaping.output import ChatOutput, ReasoningSplitter, ToolCallDetector
from skippyd.http.shaping.sse import (
    SSE_DONE,
    SSE_KEEP_ALIVE,
    ResponseShape,
    add_timings,
    make_usage,
    sse_event,
)

logger = logging.getLogger(__name__)

_DONE = object()


@dataclass(frozen=True, slots=True)
class Shaping:
    """How the text of every choice of one response is shaped."""

    kind: Literal["chat", "completion"]
    logprobs: int | None = None
    """Report log-probabilities (this many alternatives); None: no logprobs."""
    tools: ToolSpec | None = None
    tool_format: ToolFormat = "generic"
    reasoning_open: bool | None = None
    """Split ``<think>`` text off (True: the prompt opened it); None: never."""
    echo_text: str | None = None
    """Completions ``echo``: the prompt's text, returned before the generated text."""
    prompt_tokens: tuple[int, ...] = ()
    score_only: bool = False
    """``max_tokens: 0`` with echo: the generated token is computed but not returned."""


class Choice:
    """One choice: its generation and the shaping of its output.

    Args:
        index: The choice's ``index``.
        stream: Its generation.
        shaping: How text is shaped.
        backend: For token texts (log-probabilities).
        prompt_source: The choice whose generation computes the prompt's
            log-probabilities (itself for the first choice).
    """

    def __init__(self, index: int, stream: GenerationStream, shaping: Shaping,
                 backend: ServingBackend, prompt_source: Choice | None = None) -> None:
        self.index = index
        self.stream = stream
        self._shaping = shaping
        self._backend = backend
        self._prompt_source = prompt_source or self
        self._output: ChatOutput | None = None
        if shaping.kind == "chat":
            tools = shaping.tools
            active = tools is not None and tools.choice != "none"
            self._output = ChatOutput(
                None if shaping.reasoning_open is None
                else ReasoningSplitter(shaping.reasoning_open),
                ToolCallDetector(tools, shaping.tool_format) if active and tools else None)
        self._pending: list[Any] = []
        self._text_offset = len(shaping.echo_text or "")

    @property
    def completion_tokens(self) -> int:
        return 0 if self._shaping.score_only else self.stream.num_completion_tokens

    # -- non-streaming -----------------------------------------------------------------

    def whole(self, text: str) -> dict[str, Any]:
        """The choice's JSON once its generation finished with ``text``."""
        shaping, reason = self._shaping, self.stream.finish_reason or "stop"
        entries = [] if shaping.score_only else self.stream.take_logprobs()
        if self._output is not None:
            message, called = self._output.whole(text)
            logprobs = (None if shaping.logprobs is None
                        else chat_logprobs(entries, self._backend.token_bytes))
            return ResponseShape.chat_choice(self.index, message,
                                             "tool_calls" if called else reason, logprobs)
        body = "" if shaping.score_only else text
        logprobs = None
        if shaping.logprobs is not None:
            logprobs = completion_logprobs(self._echo_entries() + [(e.token, e) for e in entries],
                                           self._backend.token_bytes, 0)
        return ResponseShape.completion_choice(self.index, (shaping.echo_text or "") + body,
                                               "length" if shaping.score_only else reason,
                                               logprobs)

    def _echo_entries(self) -> list[tuple[int, Any]]:
        if self._shaping.echo_text is None:
            return []
        known = self._prompt_source.stream.prompt_logprobs
        return [(token, known.get(position))
                for position, token in enumerate(self._shaping.prompt_tokens)]

    # -- streaming ---------------------------------------------------------------------

    async def events(self, shape: ResponseShape,
                     keep_alive_s: float | None) -> AsyncIterator[bytes]:
        """This choice's SSE events, one write per wake-up, the last with its finish reason.

        As for a plain stream, the chat role chunk goes out with the first text, and a
        quiet wait longer than ``keep_alive_s`` sends a keep-alive comment.
        """
        opening = shape.first_chunk(self.index)
        echo = self._shaping.echo_text is not None
        while True:
            pieces = await self.stream.next_pieces(keep_alive_s)
            if pieces is None:
                yield SSE_KEEP_ALIVE
                continue
            if not pieces and self.stream.finished:
                break
            events = self._piece_events(shape, pieces)
            if echo and pieces:
                events.insert(0, await self._echo_event(shape))
                echo = False
            if opening is not None and events:
                events.insert(0, sse_event(opening))
                opening = None
            if events:
                yield b"".join(events)
        closing = [sse_event(chunk) for chunk in self._final_chunks(shape)]
        if echo:
            closing.insert(0, await self._echo_event(shape))
        if opening is not None:
            closing.insert(0, sse_event(opening))
        yield b"".join(closing)

    async def _echo_event(self, shape: ResponseShape) -> bytes:
        logprobs = None
        if self._shaping.logprobs is not None:
            await self._prompt_source.stream.prompt_done.wait()
            logprobs = completion_logprobs(self._echo_entries(), self._backend.token_bytes, 0)
        return sse_event(shape.text_chunk(self._shaping.echo_text or "", index=self.index,
                                          logprobs=logprobs))

    def _piece_events(self, shape: ResponseShape, pieces: list[str]) -> list[bytes]:
        if self._shaping.score_only or not pieces:  # held text: its logprobs wait for it
            return []
        if self._shaping.logprobs is not None:  # one chunk per wake-up, with its tokens
            chunk = self._piece_chunk(shape, "".join(pieces))
            return [] if chunk is None else [sse_event(chunk)]
        events = []
        for piece in pieces:
            if self._output is None:
                events.append(self._text_event(shape, piece))
                continue
            delta = self._output.push(piece)
            if delta.reasoning:
                events.append(sse_event(shape.delta_chunk(
                    {"reasoning_content": delta.reasoning}, index=self.index)))
            if delta.content:
                events.append(self._text_event(shape, delta.content))
        return events

    def _text_event(self, shape: ResponseShape, text: str) -> bytes:
        if self.index == 0:
            return shape.text_event(text)
        return sse_event(shape.text_chunk(text, index=self.index))

    def _piece_chunk(self, shape: ResponseShape, piece: str) -> dict[str, Any] | None:
        self._pending.extend(self.stream.take_logprobs())
        if self._output is None:
            return shape.text_chunk(piece, index=self.index, logprobs=self._take_logprobs())
        delta = self._output.push(piece).as_delta()
        if not delta:
            return None
        return shape.delta_chunk(delta, index=self.index, logprobs=self._take_logprobs())

    def _final_chunks(self, shape: ResponseShape) -> list[dict[str, Any]]:
        self._pending.extend([] if self._shaping.score_only else self.stream.take_logprobs())
        reason = self.stream.finish_reason or "stop"
        if self._output is None:
            reason = "length" if self._shaping.score_only else reason
            return [shape.text_chunk("", reason, index=self.index,
                                     logprobs=self._take_logprobs())]
        last = self._output.finish()
        chunks = []
        calls = last.tool_calls
        last.tool_calls = []
        if last.as_delta():
            chunks.append(shape.delta_chunk(last.as_delta(), index=self.index,
                                            logprobs=self._take_logprobs()))
        if calls:
            last.tool_calls, last.content, last.reasoning = calls, "", ""
            chunks.append(shape.delta_chunk(last.as_delta(), index=self.index))
            reason = "tool_calls"
        chunks.append(shape.delta_chunk({}, reason, index=self.index,
                                        logprobs=self._take_logprobs()))
        return chunks

    def _take_logprobs(self) -> dict[str, Any] | None:
        if self._shaping.logprobs is None:
            return None
        entries, self._pending = self._pending, []
        if self._output is not None:
            return chat_logprobs(entries, self._backend.token_bytes)
        logprobs = completion_logprobs([(e.token, e) for e in entries],
                                       self._backend.token_bytes, self._text_offset)
        self._text_offset += sum(len(token) for token in logprobs["tokens"])
        return logprobs


def usage_of(choices: Sequence[Choice], clamp: tuple[int, int] | None) -> dict[str, Any]:
    """``usage``: the prompt once, the completions of every choice."""
    lead = choices[0].stream
    return make_usage(lead.num_prompt_tokens, sum(c.completion_tokens for c in choices),
                      lead.cached_tokens(), clamp, drafts_of(choices))


def drafts_of(choices: Sequence[Choice]) -> tuple[int, int] | None:
    """(drafted, accepted) tokens of every choice, or None when none drafted."""
    drafted = sum(c.stream.num_drafted for c in choices)
    if not drafted:
        return None
    return drafted, sum(c.stream.num_accepted for c in choices)


async def stream_events(choices: Sequence[Choice], shape: ResponseShape, include_usage: bool,
                        clamp: tuple[int, int] | None,
                        keep_alive_s: float | None) -> AsyncIterator[bytes]:
    """Encode every choice's chunks as SSE events; an error becomes an error event."""
    try:
        merged = (choices[0].events(shape, keep_alive_s) if len(choices) == 1
                  else _merged(choices, shape, keep_alive_s))
        async for event in merged:
            yield event
        if include_usage:
            yield sse_event(add_timings(shape.usage_chunk(usage_of(choices, clamp)),
                                        drafts_of(choices)))
    except ApiError as exc:
        yield sse_event(exc.to_body())
    yield SSE_DONE


async def _merged(choices: Sequence[Choice], shape: ResponseShape,
                  keep_alive_s: float | None) -> AsyncIterator[bytes]:
    """Interleave the choices' events as they come; the first error ends them all."""
    # NOTE: unbounded, but each choice queues at most one write per generated token.
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for event in choice.events(shape, None):
                queue.put_nowait(event)
        except ApiError as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.ensure_future(pump(choice)) for choice in choices]
    try:
        running = len(tasks)
        while running:
            try:
                item = await asyncio.wait_for(queue.get(), keep_alive_s)
            except TimeoutError:
                yield SSE_KEEP_ALIVE
                continue
            if item is _DONE:
                running -= 1
            elif isinstance(item, ApiError):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def complete_response(request: Request, choices: Sequence[Choice], shape: ResponseShape,
                    clamp: tuple[int, int] | None) -> Response:
    """Collect every choice's text, giving up as soon as the client disconnects."""
    collect = asyncio.ensure_future(_collect_all(choices))
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collect, watcher):
            task.cancel()
        await asyncio.gather(collect, watcher, return_exceptions=True)
    if collect.cancelled():
        logger.info("client left before %s finished", shape.response_id)
        return Response(status_code=499)
    texts = collect.result()
    body = [choice.whole(text) for choice, text in zip(choices, texts, strict=True)]
    return JSONResponse(add_timings(shape.full_body_choices(body, usage_of(choices, clamp)),
                                    drafts_of(choices)))


async def _collect_all(choices: Sequence[Choice]) -> list[str]:
    # NOTE: a task around gather: a cancelled task reads as cancelled, a cancelled gather
    # future (Python 3.11) as failed with CancelledError.
    return list(await asyncio.gather(*(choice.stream.collect() for choice in choices)))


async def _wait_for_disconnect(request: Request) -> None:
    # NOTE: the body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
