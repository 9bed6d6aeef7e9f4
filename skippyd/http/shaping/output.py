"""A chat choice's generated text split into what the API returns: reasoning, content and
tool calls.

Text arrives in pieces. :class:`ReasoningSplitter` sends what a thinking model writes
inside ``<think>…</think>`` to ``reasoning_content``; :class:`ToolCallDetector` passes
plain text through and holds back everything from the first tool-call marker on, to be
parsed into calls at the end. Both hold back a piece's tail while it may be the start
of a tag, so no partial tag ever reaches the client.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from skippyd.http.parsing.tools import (
    CALL_MARKERS,
    ToolCall,
    ToolFormat,
    ToolSpec,
    parse_tool_calls,
)

logger = logging.getLogger(__name__)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:length]):
                best = length
                break
    return best


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the model inside ``<think>`` (the template opened it)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


class ReasoningSplitter:
    """Route text inside ``<think>…</think>`` to reasoning, the rest to content.

    Args:
        start_open: The prompt already opened the think block.
    """

    def __init__(self, start_open: bool) -> None:
        self._state = "reasoning" if start_open else "start"
        self._held = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        """Feed a piece; returns ``(kind, text)`` parts, kind ``reasoning`` or ``content``."""
        buffer, self._held = self._held + text, ""
        parts: list[tuple[str, str]] = []
        while buffer:
            if self._state == "start":
                stripped = buffer.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._state, buffer = "reasoning", stripped[len(THINK_OPEN):]
                elif THINK_OPEN.startswith(stripped):
                    self._held = buffer  # whitespace or a partial "<think>": undecided
                    break
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                end = buffer.find(THINK_CLOSE)
                if end >= 0:
                    parts.append(("reasoning", buffer[:end]))
                    self._state, buffer = "after", buffer[end + len(THINK_CLOSE):]
                    continue
                keep = partial_suffix(buffer, (THINK_CLOSE,))
                parts.append(("reasoning", buffer[:len(buffer) - keep]))
                self._held = buffer[len(buffer) - keep:]
                break
            elif self._state == "after":  # the blank lines between reasoning and answer
                buffer = buffer.lstrip()
                if buffer:
                    self._state = "content"
            else:
                parts.append(("content", buffer))
                break
        return [(kind, part) for kind, part in parts if part]

    def flush(self) -> list[tuple[str, str]]:
        held, self._held = self._held, ""
        if not held:
            return []
        return [("reasoning" if self._state == "reasoning" else "content", held)]


class ToolCallDetector:
    """Pass content through until a tool call starts; parse the calls at the end.

    A forced call (``required`` / a named function) and a Llama 3 reply opening with
    ``{`` are held back from their first character.
    """

    def __init__(self, spec: ToolSpec, fmt: ToolFormat) -> None:
        self._spec = spec
        self._fmt = fmt
        self._held = ""
        self._calling: list[str] | None = None
        self._at_start = True

    def push(self, text: str) -> str:
        """Feed content; returns the content that is safe to send now."""
        if self._calling is not None:
            self._calling.append(text)
            return ""
        buffer, self._held = self._held + text, ""
        if self._at_start:
            stripped = buffer.lstrip()
            if not stripped:
                self._held = buffer
                return ""
            self._at_start = False
            if self._spec.forced or (self._fmt == "llama3" and stripped[0] == "{"):
                self._calling = [buffer]
                return ""
        starts = [i for i in (buffer.find(m) for m in CALL_MARKERS) if i >= 0]
        if starts:
            self._calling = [buffer[min(starts):]]
            return buffer[:min(starts)]
        keep = partial_suffix(buffer, CALL_MARKERS)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content still held, and the calls (empty when the text made none)."""
        if self._calling is None:
            held, self._held = self._held, ""
            return held, []
        text = "".join(self._calling)
        content, calls = parse_tool_calls(text, self._spec)
        if not calls:
            if self._spec.forced:
                logger.warning("a forced tool call did not parse; returning it as text")
            return text, []
        return content, calls


@dataclass(slots=True)
class ChatDelta:
    """What one step of a chat choice adds."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def as_delta(self) -> dict[str, object]:
        delta: dict[str, object] = {}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = [call.to_dict(i) for i, call in enumerate(self.tool_calls)]
        return delta


class ChatOutput:
    """One chat choice's text, split into reasoning, content and tool calls.

    Args:
        reasoning: Split ``<think>`` blocks off (None: all text is content).
        tools: Look for tool calls (None: the request has no active tools).
    """

    def __init__(self, reasoning: ReasoningSplitter | None,
                 tools: ToolCallDetector | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def push(self, text: str) -> ChatDelta:
        parts = self._reasoning.push(text) if self._reasoning else [("content", text)]
        return self._route(parts)

    def finish(self) -> ChatDelta:
        delta = self._route(self._reasoning.flush() if self._reasoning else [])
        if self._tools is not None:
            content, calls = self._tools.finish()
            delta.content += content
            delta.tool_calls = calls
        return delta

    def _route(self, parts: list[tuple[str, str]]) -> ChatDelta:
        delta = ChatDelta()
        for kind, text in parts:
            if kind == "reasoning":
                delta.reasoning += text
            else:
                delta.content += self._tools.push(text) if self._tools else text
        return delta

    def whole(self, text: str) -> tuple[dict[str, object], bool]:
        """The non-streaming ``message`` for ``text``, and whether it made tool calls."""
        first, last = self.push(text), self.finish()
        content = first.content + last.content
        message: dict[str, object] = {"role": "assistant", "content": content}
        reasoning = first.reasoning + last.reasoning
        if reasoning:
            message["reasoning_content"] = reasoning
        if last.tool_calls:
            message["content"] = content or None
            message["tool_calls"] = [call.to_dict() for call in last.tool_calls]
        return message, bool(last.tool_calls)
