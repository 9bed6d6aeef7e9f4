"""Tool calling: the ``tools`` / ``tool_choice`` fields, the models' call formats, parsing.

Tools reach the model through its own chat template when the template renders them
(``tools`` is passed to it, as Hugging Face templates expect). A template that knows
nothing of tools gets them as a system message asking for Hermes-style calls
(``<tool_call>{"name": …, "arguments": …}</tool_call>``), the format small instruct
models follow best. Replies are parsed for the common formats: Hermes/Qwen
``<tool_call>`` blocks, Mistral ``[TOOL_CALLS]``, and Llama 3.x bare JSON. For
``tool_choice: "required"`` or a named function, :func:`call_grammar` gives the schema
and the wrapping of a call in the model's format, so a grammar makes every reply a call.
"""

from __future__ import annotations

import json
import logging
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from skippyd.http.api_errors import invalid_field

logger = logging.getLogger(__name__)

ToolFormat = Literal["hermes", "mistral", "llama3", "generic"]
#: Most tools one request may declare.
MAX_TOOLS = 128
#: Text that starts a call in one of the formats.
CALL_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_MISTRAL_ARGS = re.compile(r"\s*([A-Za-z0-9_.-]+)\[ARGS\]", re.DOTALL)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """The tools of a chat request and how the model may use them."""

    tools: tuple[dict[str, Any], ...]
    """The ``tools`` entries as sent (``{"type": "function", "function": {...}}``)."""
    choice: str
    """``auto``, ``none``, ``required``, or the name of the one function to call."""
    parallel: bool = True
    """``parallel_tool_calls``: more than one call per reply."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool["function"]["name"] for tool in self.tools)

    @property
    def forced(self) -> bool:
        """The reply must be a call (``required`` or a named function)."""
        return self.choice not in ("auto", "none")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made."""

    name: str
    arguments: str
    """The arguments as a JSON object text."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            body = {"index": index, **body}
        return body


# -- request fields ----------------------------------------------------------------------

def parse_tools(body: dict[str, Any]) -> ToolSpec | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when no tools are given.

    Raises:
        ApiError: 400 naming the malformed field.
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid_field("parallel_tool_calls", "must be a boolean")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise invalid_field("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid_field("tools", f"must be a list of at most {MAX_TOOLS} tools")
    parsed = tuple(_parse_tool(index, tool) for index, tool in enumerate(tools))
    names = [tool["function"]["name"] for tool in parsed]
    if len(set(names)) != len(names):
        raise invalid_field("tools", "function names must be unique")
    return ToolSpec(parsed, _parse_choice(choice, names), parallel)


def _parse_tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise invalid_field(f"{where}.type", "only function tools are supported")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid_field(f"{where}.function", "must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid_field(f"{where}.function.name",
                            "must be 1-64 letters, digits, '_', '.' or '-'")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_field(f"{where}.function.description", "must be a string")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise invalid_field(f"{where}.function.parameters", "must be a JSON Schema object")
    clean = {"name": name, "parameters": parameters}
    if description is not None:
        clean["description"] = description
    return {"type": "function", "function": clean}


def _parse_choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise invalid_field("tool_choice", "must be 'auto', 'none', 'required' or "
                            '{"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise invalid_field("tool_choice.function.name", f"{name!r} is not one of the tools")
    return name


# -- the model's format ------------------------------------------------------------------

def detect_format(template: str | None) -> ToolFormat:
    """The call format a chat template renders, or ``generic`` if it ignores tools."""
    if not template or "tools" not in template:
        return "generic"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def arguments_key(fmt: ToolFormat) -> str:
    return "parameters" if fmt == "llama3" else "arguments"


def prepare_chat(messages: list[dict[str, Any]], spec: ToolSpec | None,
                 fmt: ToolFormat) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and ``tools`` as the template gets them.

    A tool-aware template gets calls with their arguments as objects (what Hugging Face
    templates index into); a generic one gets calls and results written out as text and
    the tool list as a system message.
    """
    active = spec is not None and spec.choice != "none"
    if fmt != "generic":
        rendered = [_native_message(m) for m in messages]
        return rendered, list(spec.tools) if active and spec is not None else None
    rendered = [_generic_message(m) for m in messages]
    if active and spec is not None:
        rendered = _with_system_text(rendered, generic_tools_prompt(spec))
    return rendered, None


def _native_message(message: dict[str, Any]) -> dict[str, Any]:
    if "tool_calls" not in message:
        return message
    calls = [{**call, "function": {"name": call["function"]["name"],
                                   "arguments": json.loads(call["function"]["arguments"])}}
             for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _generic_message(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user",
                "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    if "tool_calls" in message:
        blocks = [_hermes_block(c["function"]["name"], c["function"]["arguments"])
                  for c in message["tool_calls"]]
        text = "\n".join([message["content"], *blocks] if message["content"] else blocks)
        return {"role": message["role"], "content": text}
    return {"role": message["role"], "content": message["content"]}


def _hermes_block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}".strip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def generic_tools_prompt(spec: ToolSpec) -> str:
    """The system text that teaches a template without tools about them."""
    listed = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in spec.tools)
    many = "one <tool_call></tool_call> block per call" if spec.parallel else "one block"
    return (
        "You can call functions to answer. The available functions are:\n<tools>\n"
        f"{listed}\n</tools>\nTo call a function, reply with {many}, holding a JSON "
        'object with the function\'s "name" and its "arguments":\n<tool_call>\n'
        '{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>'
    )


# -- grammar for forced calls ------------------------------------------------------------

def call_grammar(spec: ToolSpec, fmt: ToolFormat) -> tuple[dict[str, Any], str]:
    """The JSON Schema of one call and the GBNF root rule around it (rule ``call``).

    Each call is an ``anyOf`` alternative, in ``tools`` order, so a schema error at
    ``anyOf[i]`` belongs to ``tools[i]`` (see :func:`tool_error_param`).
    """
    key = arguments_key(fmt)
    names = spec.names if spec.choice == "required" else (spec.choice,)
    alternatives = []
    for tool in spec.tools:
        function = tool["function"]
        if function["name"] not in names:
            continue
        alternatives.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, key: function["parameters"]},
            "required": ["name", key],
        })
    schema = {"anyOf": alternatives}
    if fmt == "mistral":
        calls = 'call ("," space call)*' if spec.parallel else "call"
        return schema, f'"[TOOL_CALLS]" "[" space {calls} "]"'
    if fmt == "llama3":
        return schema, 'call (";" space call)*' if spec.parallel else "call"
    block = '"<tool_call>\\n" call "\\n</tool_call>"'
    return schema, f'{block} ("\\n" {block})*' if spec.parallel else block


def tool_error_param(spec: ToolSpec, path: str) -> str:
    """Map a schema-error path inside :func:`call_grammar`'s schema to the request field."""
    match = re.match(r"anyOf\[(\d+)\]\.properties\.(?:arguments|parameters)\.?(.*)", path)
    if match is None:
        return "tools"
    names = spec.names if spec.choice == "required" else (spec.choice,)
    name = names[int(match.group(1))]
    index = spec.names.index(name)
    rest = f".{match.group(2)}" if match.group(2) else ""
    return f"tools[{index}].function.parameters{rest}"


# -- parsing replies ---------------------------------------------------------------------

def parse_tool_calls(text: str, spec: ToolSpec) -> tuple[str, list[ToolCall]]:
    """Split a reply into its text and the calls it makes (none when it makes none).

    Calls naming a function that is not among the tools are left in the text.
    """
    for parse in (_parse_hermes, _parse_mistral, _parse_llama3):
        found = parse(text)
        if found is None:
            continue
        content, raw_calls = found
        mistral = parse is _parse_mistral
        calls = [call for call in (_to_call(raw, mistral) for raw in raw_calls)
                 if call is not None and call.name in spec.names]
        if calls:
            return content, calls if spec.parallel else calls[:1]
    return text, []


def _to_call(raw: Any, mistral: bool = False) -> ToolCall | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        return None
    arguments = raw.get("arguments", raw.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    call_id = raw.get("id")
    if isinstance(call_id, str) and call_id:
        return ToolCall(raw["name"], text, call_id)
    if mistral:  # Mistral templates insist on 9 letters and digits
        return ToolCall(raw["name"], text, "".join(random.choices(_ALNUM, k=9)))
    return ToolCall(raw["name"], text)


_ALNUM = string.ascii_letters + string.digits


def _parse_hermes(text: str) -> tuple[str, list[Any]] | None:
    start = text.find("<tool_call>")
    if start < 0:
        return None
    calls = [_loads(block) for block in _HERMES_BLOCK.findall(text[start:])]
    return text[:start].strip(), calls


def _parse_mistral(text: str) -> tuple[str, list[Any]] | None:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return None
    rest = text[start + len("[TOOL_CALLS]"):].strip()
    if rest.startswith("["):
        found = _loads(rest)
        return text[:start].strip(), found if isinstance(found, list) else []
    calls = []
    for match in _MISTRAL_ARGS.finditer(rest):  # newer form: name[ARGS]{...}
        arguments, _ = _raw_decode(rest, match.end())
        calls.append({"name": match.group(1), "arguments": arguments})
    return text[:start].strip(), calls


def _parse_llama3(text: str) -> tuple[str, list[Any]] | None:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    calls, offset = [], 0
    while offset < len(body):
        value, offset = _raw_decode(body, offset)
        if value is None:
            return None
        calls.append(value)
        offset = len(body) - len(body[offset:].lstrip().lstrip(";").lstrip())
    return "", calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _raw_decode(text: str, offset: int) -> tuple[Any, int]:
    try:
        return json.JSONDecoder().raw_decode(text, offset)
    except ValueError:
        return None, len(text)
