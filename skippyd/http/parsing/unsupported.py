"""Which request fields the API acts on, which it ignores on purpose, which it refuses.

Every field of a request body is one of:

* **supported**: parsed and acted on (:mod:`skippyd.http.parsing.request_params` and friends);
* **ignored**: harmless metadata that changes nothing about the output (``user``,
  ``metadata``…), accepted and listed in the README as ignored;
* **refused**: options whose value would change the output in a way this server cannot
  deliver (``suffix``, ``audio``…), answered with a 400 naming the field when they are set
  to anything but a harmless value;
* **unknown**: anything else. It is ignored, but never silently: the first request that
  carries a given unknown name is logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from skippyd.http.api_errors import invalid_field, unsupported_field

logger = logging.getLogger(__name__)

_COMMON_SUPPORTED = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k",
    "min_p", "typical_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
    "frequency_penalty", "seed", "logit_bias", "ignore_eos", "stop", "n", "logprobs",
    "response_format", "grammar", "json_schema", "min_tokens",
})
CHAT_SUPPORTED = _COMMON_SUPPORTED | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "chat_template_kwargs",
}
COMPLETION_SUPPORTED = _COMMON_SUPPORTED | {"prompt", "echo", "best_of"}
#: Metadata that never changes the output: accepted and ignored (documented).
IGNORED = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "cache_prompt",
})


def is_int(value: Any) -> bool:
    """Whether ``value`` is a JSON integer (``bool`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_set(value: Any) -> bool:
    """Whether an option is present with a value that would change the output."""
    if value is None or value is False or isinstance(value, int | float) and value == 0:
        return False
    return not (isinstance(value, str | list | dict) and not value)


def _check_flag(name: str) -> Callable[[Any], str | None]:
    return lambda value: name if is_set(value) else None


def _check_modalities(value: Any) -> str | None:
    if value is None or value == ["text"]:
        return None
    return f"modalities {value!r} (only ['text'])"


def _check_deprecated(replacement: str) -> Callable[[Any], str | None]:
    return lambda value: (None if value is None
                          else f"the deprecated form (use {replacement})")


_COMMON_REFUSED: dict[str, Callable[[Any], str | None]] = {
    "functions": _check_deprecated("tools"),
    "function_call": _check_deprecated("tool_choice"),
    "modalities": _check_modalities,
    "audio": _check_flag("audio output"),
    "prediction": _check_flag("predicted outputs"),
    "web_search_options": _check_flag("web search"),
    "mirostat": _check_flag("mirostat sampling"),
}
_COMPLETION_REFUSED = {**_COMMON_REFUSED, "suffix": _check_flag("suffix")}


def reject_unsupported(body: dict[str, Any], *, chat: bool) -> None:
    """Raise a 400 naming the first option set to something this server cannot do; log
    the first occurrence of every unknown field name.

    Args:
        body: The decoded request body.
        chat: Check the chat-completions options (else the completions ones).

    Raises:
        ApiError: 400 ``unsupported_parameter`` naming the field.
    """
    refused = _COMMON_REFUSED if chat else _COMPLETION_REFUSED
    _check_min_tokens(body)
    supported = CHAT_SUPPORTED if chat else COMPLETION_SUPPORTED
    for name, value in body.items():
        check = refused.get(name)
        if check is not None:
            detail = check(value)
            if detail is not None:
                raise unsupported_field(name, detail)
        elif name not in supported and name not in IGNORED:
            _note_unknown(name, "chat" if chat else "completions")


def _check_min_tokens(body: dict[str, Any]) -> None:
    """``min_tokens`` holds end-of-generation tokens back for that many tokens; load
    generators send it beside ``ignore_eos`` to get exact lengths. ``ignore_eos`` already
    holds them back for the whole generation, so it is honoured with it and refused
    without.
    """
    value = body.get("min_tokens")
    if value is None:
        return
    if not is_int(value) or value < 0:
        raise invalid_field("min_tokens", "must be an integer >= 0")
    if value > 0 and body.get("ignore_eos") is not True:
        raise unsupported_field("min_tokens", "min_tokens without ignore_eos: true")


_unknown_seen: set[tuple[str, str]] = set()
_unknown_lock = threading.Lock()
#: Distinct unknown names remembered; beyond it they are no longer logged (bounded).
_MAX_UNKNOWN_NAMES = 256


def _note_unknown(name: str, endpoint: str) -> None:
    key = (endpoint, name[:64])
    with _unknown_lock:
        if key in _unknown_seen or len(_unknown_seen) >= _MAX_UNKNOWN_NAMES:
            return
        _unknown_seen.add(key)
    logger.warning("%s request field %r is unknown to skippyd and is ignored "
                   "(logged once per name)", endpoint, key[1])


def check_choice_count(body: dict[str, Any], name: str, limit: int) -> int:
    """``n`` (or ``best_of``): an integer within [1, ``limit``]; 1 when absent.

    Raises:
        ApiError: 400 naming the field.
    """
    value = body.get(name)
    if value is None:
        return 1
    if not is_int(value) or not 1 <= value <= limit:
        raise invalid_field(name, f"must be an integer within [1, {limit}] (got {value!r})")
    return value
