"""The two ``logprobs`` shapes of the OpenAI API, built from the worker's log-probabilities.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``.
Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (parallel
lists; with ``echo`` the prompt's tokens come first, the very first one with ``null``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from skippyd.engine.runtime.contract import TokenLogprob

logger = logging.getLogger(__name__)

#: What a log-probability too small for JSON (or -inf) is reported as, as OpenAI does.
FLOOR = -9999.0

TokenBytes = Callable[[int], bytes]


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > FLOOR else FLOOR


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def chat_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytes) -> dict[str, Any]:
    """The chat ``logprobs`` object for these tokens."""
    content = []
    for entry in entries:
        piece = token_bytes(entry.token)
        content.append({
            "token": _text(piece), "logprob": _value(entry.logprob), "bytes": list(piece),
            "top_logprobs": [
                {"token": _text(alt), "logprob": _value(lp), "bytes": list(alt)}
                for alt, lp in ((token_bytes(t), lp) for t, lp in entry.top)
            ],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[tuple[int, TokenLogprob | None]],
                        token_bytes: TokenBytes, text_offset: int) -> dict[str, Any]:
    """The completions ``logprobs`` object.

    Args:
        entries: (token, its log-probability or None for the prompt's first token).
        token_bytes: A token's text as bytes.
        text_offset: Character offset of the first token in the choice's text.
    """
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token, entry in entries:
        text = _text(token_bytes(token))
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_value(entry.logprob))
        top: dict[str, float] = {}
        for alt, lp in entry.top:  # distinct tokens may share a text: keep the likeliest
            top.setdefault(_text(token_bytes(alt)), _value(lp))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}
