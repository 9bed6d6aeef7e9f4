"""A chat choice's text split into reasoning, content and tool calls, piece by piece."""

from __future__ import annotations

import json

import pytest

from skippyd.http.parsing.tools import ToolSpec
from skippyd.http.shaping.output import (
    ChatOutput,
    ReasoningSplitter,
    ToolCallDetector,
    opens_reasoning,
)

TOOLS = (
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
)


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def split(text: str, size: int, start_open: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(start_open)
    parts = [p for piece in pieces_of(text, size) for p in splitter.push(piece)]
    parts += splitter.flush()
    return ("".join(t for k, t in parts if k == "reasoning"),
            "".join(t for k, t in parts if k == "content"))


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_think_blocks_become_reasoning_in_any_piece_size(size: int) -> None:
    assert split("<think>\nI'm thinking\n</think>\n\nHello!", size) == (
        "\nI'm thinking\n", "Hello!")
    assert split("I'm thinking</think>Answer", size, start_open=True) == ("I'm thinking",
                                                                          "Answer")
    assert split("  No tags < here>", size) == ("", "  No tags < here>")
    assert split("<thin", size) == ("", "<thin")  # never became a tag: it is content
    assert split("<think>unfinished", size) == ("unfinished", "")


def test_a_prompt_that_opens_think_starts_in_reasoning() -> None:
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n</think>\n\n")


def detect(text: str, size: int, spec: ToolSpec, fmt: str = "hermes") -> tuple[str, list]:
    detector = ToolCallDetector(spec, fmt)  # type: ignore[arg-type]
    shown = "".join(detector.push(piece) for piece in pieces_of(text, size))
    rest, calls = detector.finish()
    return shown + rest, calls


@pytest.mark.parametrize("size", [1, 4, 50])
def test_text_before_a_call_streams_and_the_call_is_held(size: int) -> None:
    spec = ToolSpec(TOOLS, "auto")
    text = 'One moment.<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    detector = ToolCallDetector(spec, "hermes")
    shown = "".join(detector.push(piece) for piece in pieces_of(text, size))
    assert shown == "One moment."
    content, calls = detector.finish()  # what is still held: the text went out already
    assert content == "" and [c.name for c in calls] == ["get_time"]


@pytest.mark.parametrize("size", [1, 5])
def test_a_partial_marker_is_held_until_it_is_not_one(size: int) -> None:
    assert detect("a <tool_x> b", size, ToolSpec(TOOLS, "auto")) == ("a <tool_x> b", [])


def test_llama3_json_and_forced_calls_are_held_from_the_start() -> None:
    spec = ToolSpec(TOOLS, "auto")
    detector = ToolCallDetector(spec, "llama3")
    assert detector.push('  {"name": "get_time", ') == ""
    assert detector.push('"parameters": {}}') == ""
    assert [c.name for c in detector.finish()[1]] == ["get_time"]
    forced = ToolCallDetector(ToolSpec(TOOLS, "required"), "hermes")
    assert forced.push("not a call") == ""
    assert forced.finish() == ("not a call", [])


def test_a_whole_message_with_reasoning_and_a_call() -> None:
    output = ChatOutput(ReasoningSplitter(False), ToolCallDetector(ToolSpec(TOOLS, "auto"),
                                                                   "hermes"))
    message, called = output.whole('<think>need the time</think>\n<tool_call>\n'
                                   '{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert called
    assert message["reasoning_content"] == "need the time"
    assert message["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{}]


def test_plain_output_is_content() -> None:
    message, called = ChatOutput(None, None).whole("<think>x</think>")
    assert (message, called) == ({"role": "assistant", "content": "<think>x</think>"}, False)
