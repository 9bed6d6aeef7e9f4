"""Parse the prompt of a completions request and the messages of a chat request."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from skippyd.http.api_errors import invalid_field, unsupported_field
from skippyd.http.parsing.unsupported import is_int, is_set

logger = logging.getLogger(__name__)

_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,31}")


def parse_prompt(value: Any, n_vocab: int | None) -> str | tuple[int, ...]:
    """Parse ``prompt``: a string, a list of token ids, or a one-element list of either.

    Args:
        value: The ``prompt`` field.
        n_vocab: Vocabulary size to check token ids against, if known.

    Returns:
        The prompt text or its token ids.

    Raises:
        ApiError: 400 naming ``prompt`` (several prompts in one request included).
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise invalid_field("prompt", "must be a string or a non-empty list of token ids")
    if all(is_int(item) for item in value):
        return _check_token_ids(value, n_vocab)
    if all(isinstance(item, str | list) for item in value):
        if len(value) > 1:
            raise unsupported_field("prompt", f"a batch of {len(value)} prompts")
        return parse_prompt(value[0], n_vocab)
    raise invalid_field("prompt", "must be a string or a list of integer token ids")


def _check_token_ids(ids: list[int], n_vocab: int | None) -> tuple[int, ...]:
    limit = n_vocab if n_vocab is not None else 2**31
    for token in ids:
        if not 0 <= token < limit:
            raise invalid_field("prompt", f"token id {token} is outside [0, {limit})")
    return tuple(ids)


def parse_messages(value: Any) -> tuple[dict[str, Any], ...]:
    """Parse ``messages`` into ``{"role", "content"}`` dicts with text content.

    An assistant message may carry ``tool_calls`` (kept as OpenAI sends them, arguments
    checked to be JSON); a ``tool`` message keeps its ``tool_call_id`` (and ``name``).

    Raises:
        ApiError: 400 naming the message field at fault; non-text content parts are
            refused as unsupported.
    """
    if not isinstance(value, list) or not value:
        raise invalid_field("messages", "must be a non-empty list of message objects")
    return tuple(_parse_message(index, item) for index, item in enumerate(value))


def _parse_message(index: int, item: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(item, dict):
        raise invalid_field(where, "must be an object")
    role = item.get("role")
    if not isinstance(role, str) or not _ROLE.fullmatch(role):
        # NOTE: the template prints the role verbatim: free text there could spell the
        # template's markup (a role of "user<|im_end|>..." forges a system turn).
        raise invalid_field(f"{where}.role", "must be a role name such as \"user\" "
                            "(1-32 letters, digits, \"_\", \"-\" or \".\")")
    if is_set(item.get("function_call")):
        raise unsupported_field(f"{where}.function_call", "the deprecated form (use tool_calls)")
    # NOTE: chat templates predate the "developer" role; it means "system" to them.
    role = "system" if role == "developer" else role
    message: dict[str, Any] = {"role": role, "content": _parse_content(where, item.get("content"))}
    if is_set(item.get("tool_calls")):
        message["tool_calls"] = _parse_tool_calls(where, item["tool_calls"])
    for key in ("tool_call_id", "name"):
        value = item.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise invalid_field(f"{where}.{key}", "must be a string")
            message[key] = value
    return message


def _parse_tool_calls(where: str, value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise invalid_field(f"{where}.tool_calls", "must be a list of tool calls")
    calls = []
    for index, call in enumerate(value):
        at = f"{where}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid_field(f"{at}.function.name", "must be a string")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise invalid_field(f"{at}.function.arguments", "must be a JSON string")
        try:
            json.loads(arguments)
        except ValueError as exc:
            raise invalid_field(f"{at}.function.arguments", f"is not valid JSON: {exc}") from None
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise invalid_field(f"{at}.id", "must be a string")
        calls.append({"id": call_id or f"call_{index}", "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def _parse_content(where: str, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_field(f"{where}.content", "must be a string or a list of content parts")
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict):
            raise invalid_field(f"{where}.content[{index}]", "must be an object")
        if part.get("type") != "text":
            raise unsupported_field(f"{where}.content[{index}].type", repr(part.get("type")))
        if not isinstance(part.get("text"), str):
            raise invalid_field(f"{where}.content[{index}].text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)
