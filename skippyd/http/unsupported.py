"""Options of the OpenAI API this server refuses instead of silently ignoring.

Each check looks at one body field and returns what is unsupported about its value (for
the 400 message), or None when the value is absent or harmless (``n: 1``,
``tool_choice: "none"``, ``response_format: {"type": "text"}``…).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from skippyd.http.errors import invalid_field, unsupported_field

logger = logging.getLogger(__name__)


def is_int(value: Any) -> bool:
    """Whether ``value`` is a JSON integer (``bool`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_set(value: Any) -> bool:
    """Whether an option is present with a value that would change the output."""
    if value is None or value is False or isinstance(value, int | float) and value == 0:
        return False
    return not (isinstance(value, str | list | dict) and not value)


def _check_logprobs(value: Any) -> str | None:
    # NOTE: unlike the other flags, completions' ``logprobs: 0`` still asks for the
    # sampled token's log-probability, so only null and false are accepted.
    return None if value is None or value is False else "logprobs"


def _check_n(name: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value is None:
            return None
        if not is_int(value) or value < 1:
            raise invalid_field(name, f"must be an integer >= 1 (got {value!r})")
        return f"{name} > 1" if value > 1 else None

    return check


def _check_choice(name: str) -> Callable[[Any], str | None]:
    return lambda value: None if value in (None, "none") else f"{name} other than 'none'"


def _check_response_format(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_field("response_format", "must be an object")
    kind = value.get("type")
    return None if kind == "text" else f"response_format type {kind!r}"


def _check_flag(name: str) -> Callable[[Any], str | None]:
    return lambda value: name if is_set(value) else None


_COMMON_UNSUPPORTED: dict[str, Callable[[Any], str | None]] = {
    "n": _check_n("n"),
    "logprobs": _check_logprobs,
    "top_logprobs": _check_flag("top_logprobs"),
    "tools": _check_flag("tools"),
    "functions": _check_flag("functions"),
    "tool_choice": _check_choice("tool_choice"),
    "function_call": _check_choice("function_call"),
    "response_format": _check_response_format,
}
_COMPLETION_UNSUPPORTED = {
    **_COMMON_UNSUPPORTED,
    "best_of": _check_n("best_of"),
    "echo": _check_flag("echo"),
    "suffix": _check_flag("suffix"),
}
_CHAT_UNSUPPORTED = _COMMON_UNSUPPORTED


def reject_unsupported(body: dict[str, Any], *, chat: bool) -> None:
    """Raise a 400 naming the first option set to something this server cannot do.

    Args:
        body: The decoded request body.
        chat: Check the chat-completions options (else the completions ones).

    Raises:
        ApiError: 400 ``unsupported_parameter`` naming the field.
    """
    checks = _CHAT_UNSUPPORTED if chat else _COMPLETION_UNSUPPORTED
    for name, check in checks.items():
        detail = check(body.get(name))
        if detail is not None:
            raise unsupported_field(name, detail)
