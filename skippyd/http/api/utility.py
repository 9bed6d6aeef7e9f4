"""llama-server's utility endpoints: ``/tokenize``, ``/detokenize``, ``/apply-template``,
``/props``, with its names and shapes.
"""

from __future__ import annotations

import logging
from typing import Any

from skippyd.engine.runtime.contract import SamplingConfig
from skippyd.http.api_errors import invalid_field
from skippyd.http.backend import ServingBackend
from skippyd.http.parsing.unsupported import is_int

logger = logging.getLogger(__name__)


def parse_tokenize(body: Any) -> tuple[str, bool, bool, bool]:
    """``{"content", "add_special", "parse_special", "with_pieces"}`` of ``POST /tokenize``.

    ``parse_special`` defaults to false, unlike llama-server's: the ids then match what
    skippyd computes for the same text sent as a completions prompt (prompts and chat
    content are tokenized as text). ``true`` turns the text of control tokens, such as
    a rendered chat template's markup, into those tokens.

    Raises:
        ApiError: 400 naming the bad field.
    """
    if not isinstance(body, dict):
        raise invalid_field("content", "the body must be a JSON object")
    content = body.get("content")
    if not isinstance(content, str):
        raise invalid_field("content", "must be a string")
    flags = []
    for name in ("add_special", "parse_special", "with_pieces"):
        value = body.get(name, False)
        if not isinstance(value, bool):
            raise invalid_field(name, "must be a boolean")
        flags.append(value)
    return content, flags[0], flags[1], flags[2]


def tokenize_body(backend: ServingBackend, tokens: list[int], with_pieces: bool) -> dict:
    """The ``/tokenize`` answer: ids, or ``{"id", "piece"}`` pairs (bytes when not UTF-8)."""
    if not with_pieces:
        return {"tokens": tokens}
    pieces = []
    for token in tokens:
        raw = backend.token_bytes(token)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": token, "piece": piece})
    return {"tokens": pieces}


def parse_detokenize(body: Any, n_vocab: int) -> list[int]:
    """``{"tokens": [...]}`` of ``POST /detokenize``.

    Raises:
        ApiError: 400 naming ``tokens``.
    """
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise invalid_field("tokens", "must be a list of token ids")
    bad = [t for t in tokens if not 0 <= t < n_vocab]
    if bad:
        raise invalid_field("tokens", f"token id {bad[0]} is outside [0, {n_vocab})")
    return tokens


def props_body(backend: ServingBackend, sampling: SamplingConfig,
               default_max_tokens: int | None) -> dict[str, Any]:
    """``GET /props``: llama-server's server properties, plus the stage's layer range."""
    facts = backend.describe()
    n_ctx = backend.max_context_tokens
    return {
        "default_generation_settings": {
            "n_ctx": n_ctx,
            "params": {
                "temperature": sampling.temperature, "top_k": sampling.top_k,
                "top_p": sampling.top_p, "min_p": sampling.min_p,
                "repeat_penalty": sampling.repeat_penalty,
                "n_predict": -1 if default_max_tokens is None else default_max_tokens,
            },
        },
        "total_slots": facts.get("lane_count"),
        "model_path": facts.get("model_path"),
        "model_alias": backend.model_id,
        "chat_template": backend.chat_template or "",
        "bos_token": facts.get("bos_token", ""),
        "eos_token": facts.get("eos_token", ""),
        "modalities": {"vision": False, "audio": False},
        "layer_start": facts.get("layer_start"),
        "layer_end": facts.get("layer_end"),
        "n_layer": facts.get("n_layer"),
        "fast_paths": facts.get("fast_paths"),
        "offload": facts.get("offload"),
        "build_info": "skippyd",
    }
