"""Work a request needs before it can be submitted, done in the text thread pool.

Rendering a chat (with its tools, through the model's template), tokenizing it, and
turning a constraint into a grammar llama.cpp has parsed: all of it can take a while, so
none of it runs on the event loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from skippyd.http.api_errors import ApiError, invalid_field
from skippyd.http.backend import ServingBackend
from skippyd.http.parsing.constraints import OutputConstraint
from skippyd.http.parsing.request_params import ChatParams
from skippyd.http.parsing.tools import (
    ToolFormat,
    ToolSpec,
    call_grammar,
    detect_format,
    prepare_chat,
    tool_error_param,
)
from skippyd.http.shaping.output import opens_reasoning

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat request ready to submit."""

    tokens: list[int]
    grammar: str | None
    tool_format: ToolFormat
    reasoning_open: bool
    """The rendered prompt ends inside ``<think>``: the reply starts as reasoning."""


def render_chat(backend: ServingBackend, parsed: ChatParams, *,
                add_generation_prompt: bool = True) -> tuple[str, ToolFormat]:
    """The chat's prompt text (``/apply-template``), and the template's tool-call format.

    Raises:
        ApiError: 400 naming ``tools`` or ``messages`` when the template refuses them.
    """
    fmt = detect_format(backend.chat_template)
    messages, tools = prepare_chat([dict(m) for m in parsed.messages], parsed.tools, fmt)
    try:
        text = backend.render_chat(messages, tools=tools, template_kwargs=parsed.template_kwargs,
                                   add_generation_prompt=add_generation_prompt)
    except ValueError as exc:
        raise _template_error(backend, messages, tools, parsed, exc) from exc
    return text, fmt


def prepare_chat_request(backend: ServingBackend, parsed: ChatParams) -> PreparedChat:
    """Render, tokenize and compile the grammar of a chat request (thread pool)."""
    fmt = detect_format(backend.chat_template)
    messages, tools = prepare_chat([dict(m) for m in parsed.messages], parsed.tools, fmt)
    try:
        tokens, text = backend.chat_tokens(messages, tools=tools,
                                           template_kwargs=parsed.template_kwargs)
    except ValueError as exc:
        raise _template_error(backend, messages, tools, parsed, exc) from exc
    grammar = None
    if parsed.params.constraint is not None:
        grammar = constraint_grammar(backend, parsed.params.constraint)
    elif parsed.tools is not None and parsed.tools.forced:
        grammar = tool_call_grammar(backend, parsed.tools, fmt)
    return PreparedChat(tokens, grammar, fmt, opens_reasoning(text))


def _template_error(backend: ServingBackend, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None, parsed: ChatParams,
                    exc: ValueError) -> ApiError:
    """400 naming ``tools`` when the template takes the messages without them (a template
    that refuses tool definitions), else ``messages``."""
    if tools:
        try:
            backend.render_chat(messages, tools=None, template_kwargs=parsed.template_kwargs)
        except ValueError:
            pass
        else:
            return invalid_field("tools", f"chat template rejected the tool definitions: {exc}")
    return invalid_field("messages", f"chat template rejected the messages: {exc}")


def constraint_grammar(backend: ServingBackend, constraint: OutputConstraint) -> str:
    """The checked GBNF grammar of a constraint.

    Raises:
        ApiError: 400 naming the field (and the schema keyword) that cannot be enforced.
    """
    if constraint.kind == "grammar":
        assert constraint.grammar is not None
        try:
            backend.check_grammar(constraint.grammar)
        except ValueError as exc:
            raise invalid_field("grammar", str(exc)) from None
        return constraint.grammar
    try:
        return backend.schema_grammar(constraint.schema_or_object())
    except ValueError as exc:
        raise _schema_error(constraint.param, exc) from None


def tool_call_grammar(backend: ServingBackend, spec: ToolSpec, fmt: ToolFormat) -> str:
    """The grammar that makes every reply a call of the allowed tools.

    Raises:
        ApiError: 400 naming the tool parameter the grammar cannot enforce.
    """
    schema, root = call_grammar(spec, fmt)
    try:
        return backend.schema_grammar(schema, root)
    except ValueError as exc:
        path = getattr(exc, "path", "")
        reason = getattr(exc, "reason", str(exc))
        raise invalid_field(tool_error_param(spec, path),
                            f"{reason} (needed to force a tool call)") from None


def _schema_error(param: str, exc: ValueError) -> ApiError:
    path = getattr(exc, "path", "")
    reason = getattr(exc, "reason", str(exc))
    error = invalid_field(f"{param}.{path}" if path else param, reason)
    error.code = "unsupported_schema"
    return error


def check_local_sampling(backend: ServingBackend, **wanted: Any) -> None:
    """Refuse options that need this process to sample when it does not (split stage 0).

    Args:
        backend: The backend.
        **wanted: Field name -> whether the request uses it.

    Raises:
        ApiError: 400 naming the first such field.
    """
    if backend.local_sampling:
        return
    for name, used in wanted.items():
        if used:
            raise ApiError(400, f"{name}: not available on a split pipeline (the final stage "
                           "samples, without grammars or log-probabilities)", param=name,
                           code="unsupported_parameter")
