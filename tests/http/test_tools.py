"""Tool calling against real chat templates: rendering, the call formats, parsing replies.

The templates under ``templates/`` are the models' own (as llama.cpp keeps them for its
tests); the replies are what those models write when they call a tool.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skippyd.engine.runtime.tokenizer import _compile_template
from skippyd.http.parsing.tools import (
    ToolSpec,
    call_grammar,
    detect_format,
    parse_tool_calls,
    prepare_chat,
    tool_error_param,
)

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}
SPEC = ToolSpec((WEATHER, TIME), "auto")
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abcdefghi", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "abcdefghi", "name": "get_weather", "content": "21 C, sunny"},
]


def template(name: str) -> str:
    return (TEMPLATES / name).read_text()


def render(name: str, spec: ToolSpec | None = SPEC, messages=CONVERSATION) -> str:
    source = template(name)
    fmt = detect_format(source)
    rendered, tools = prepare_chat([dict(m) for m in messages], spec, fmt)
    return _compile_template(source).render(messages=rendered, tools=tools,
                                            add_generation_prompt=True, bos_token="<s>",
                                            eos_token="</s>")


@pytest.mark.parametrize(("name", "fmt"), [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"), ("Qwen-Qwen3-0.6B.jinja", "hermes"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
])
def test_the_format_is_read_off_the_template(name: str, fmt: str) -> None:
    assert detect_format(template(name)) == fmt


def test_a_template_without_tools_is_generic() -> None:
    smol = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    assert detect_format(smol) == "generic" and detect_format(None) == "generic"


@pytest.mark.parametrize("name", [
    "Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja", "mistralai-Mistral-Nemo-Instruct-2407.jinja",
])
def test_real_templates_render_tools_calls_and_results(name: str) -> None:
    text = render(name)
    assert "get_weather" in text and "Current weather of a city" in text
    assert "21 C, sunny" in text
    # The earlier call is rendered with its arguments as an object, not a quoted string.
    assert '"city": "Paris"' in text and '"{\\"city' not in text


def test_tool_choice_none_hides_the_tools() -> None:
    text = render("Qwen-Qwen2.5-7B-Instruct.jinja", ToolSpec((WEATHER,), "none"),
                  [{"role": "user", "content": "hi"}])
    assert "get_weather" not in text


def test_a_generic_template_gets_tools_as_a_system_message() -> None:
    messages, tools = prepare_chat([dict(m) for m in CONVERSATION], SPEC, "generic")
    assert tools is None
    assert messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": '
                           '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert messages[3] == {"role": "user",
                           "content": "<tool_response>\n21 C, sunny\n</tool_response>"}


@pytest.mark.parametrize(("reply", "content", "calls"), [
    # Qwen 2.5 / Hermes (as llama.cpp's chat tests have it)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"})]),
    ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}',  # unclosed at EOS
     "", [("get_weather", {"city": "Rome"})]),
    # Llama 3.1 / 3.2 JSON, with and without python_tag, several separated by ';'
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}', "", [("get_time", {})]),
    ('{"name": "get_weather", "parameters": {"city": "A"}}; {"name": "get_time", '
     '"parameters": {}}', "", [("get_weather", {"city": "A"}), ("get_time", {})]),
    # Mistral Nemo and the newer [ARGS] form
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
     '"id": "123456789"}]', "", [("get_weather", {"city": "Paris"})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", {"city": "Lyon"}), ("get_time", {})]),
])
def test_replies_in_every_format_are_parsed(reply: str, content: str, calls: list) -> None:
    text, parsed = parse_tool_calls(reply, SPEC)
    assert text == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    assert all(c.id for c in parsed)


@pytest.mark.parametrize("reply", [
    "The weather is fine.", '{"answer": 42}', '<tool_call>\n{"name": "rm_rf", "arguments": {}}',
    "<tool_call>\nnot json\n</tool_call>",
])
def test_text_that_makes_no_valid_call_stays_text(reply: str) -> None:
    assert parse_tool_calls(reply, SPEC) == (reply, [])


def test_mistral_ids_fit_the_template_and_single_call_mode_keeps_one() -> None:
    _, calls = parse_tool_calls('[TOOL_CALLS]get_time[ARGS]{}', SPEC)
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()
    single = ToolSpec(SPEC.tools, "auto", parallel=False)
    _, calls = parse_tool_calls('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
                                '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
                                single)
    assert len(calls) == 1


def test_forced_call_grammar_per_format() -> None:
    named = ToolSpec(SPEC.tools, "get_weather", parallel=False)
    schema, root = call_grammar(named, "hermes")
    assert [alt["properties"]["name"] for alt in schema["anyOf"]] == [{"const": "get_weather"}]
    assert root == '"<tool_call>\\n" call "\\n</tool_call>"'
    schema, root = call_grammar(ToolSpec(SPEC.tools, "required"), "llama3")
    assert [set(alt["properties"]) for alt in schema["anyOf"]] == [{"name", "parameters"}] * 2
    assert root.startswith("call")
    _, root = call_grammar(ToolSpec(SPEC.tools, "required"), "mistral")
    assert root.startswith('"[TOOL_CALLS]"')


def test_schema_errors_point_at_the_tool_parameter() -> None:
    named = ToolSpec(SPEC.tools, "get_time")
    assert (tool_error_param(named, "anyOf[0].properties.arguments.properties.x.minimum")
            == "tools[1].function.parameters.properties.x.minimum")
    required = ToolSpec(SPEC.tools, "required")
    assert (tool_error_param(required, "anyOf[0].properties.parameters")
            == "tools[0].function.parameters")
