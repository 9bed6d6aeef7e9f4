"""Parse and validate OpenAI request bodies into typed parameters.

Every check names the offending field (``param``) in a 400, and limits name the limit.
Options the server cannot honour are refused with a 400 instead of being ignored (see
:mod:`~skippyd.http.parsing.unsupported` for which fields are acted on, ignored or refused).
Parsing changes no state; the tokenizer-dependent checks (prompt length, context size)
and the grammar checks happen in the app once the prompt is tokenized.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from skippyd.engine.runtime.contract import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingConfig
from skippyd.http.api_errors import ApiError, invalid_field
from skippyd.http.parsing.constraints import OutputConstraint, parse_constraint
from skippyd.http.parsing.prompts import parse_messages, parse_prompt
from skippyd.http.parsing.tools import ToolSpec, parse_tools
from skippyd.http.parsing.unsupported import check_choice_count, is_int, reject_unsupported

logger = logging.getLogger(__name__)

_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")
_MAX_SEED = 2**64 - 1
_MAX_INT32 = 2**31 - 1
#: OpenAI's range for presence/frequency penalties and logit-bias values.
_PENALTY_RANGE = (-2.0, 2.0)
_BIAS_RANGE = (-100.0, 100.0)
#: llama-server's sampling defaults, used unless the config says otherwise.
DEFAULT_SAMPLING = SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
#: Variables every chat template gets from the server; ``chat_template_kwargs`` may not
#: replace them.
_TEMPLATE_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token",
                                "eos_token"})
_MAY_BE_ZERO = frozenset({"max_stop_strings", "max_logit_bias"})


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Per-request limits of the HTTP layer; each is enforced with a 4xx naming it."""

    max_body_bytes: int = 4 * 1024 * 1024
    """Largest accepted request body (413 above)."""
    max_prompt_tokens: int = 131_072
    """Largest prompt after tokenization, chat template applied."""
    max_tokens_limit: int = 32_768
    """Largest ``max_tokens`` / ``max_completion_tokens`` a client may ask for."""
    max_stop_strings: int = 16
    """Most entries in ``stop``."""
    max_stop_length: int = 256
    """Longest stop string, in characters."""
    max_logit_bias: int = MAX_LOGIT_BIAS
    """Most entries in ``logit_bias`` (cannot exceed the runtime's own cap)."""
    max_choices: int = 16
    """Largest ``n`` (choices per request)."""

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            # 0 stop strings or logit-bias entries is a policy: the field is refused.
            lowest = 0 if name in _MAY_BE_ZERO else 1
            if getattr(self, name) < lowest:
                raise ValueError(f"HttpLimits.{name}: must be >= {lowest} "
                                 f"(got {getattr(self, name)})")
        if self.max_logit_bias > MAX_LOGIT_BIAS:
            raise ValueError(
                f"HttpLimits.max_logit_bias: at most {MAX_LOGIT_BIAS} (got {self.max_logit_bias})"
            )


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """What both endpoints share: budget, sampling, stops and streaming options."""

    max_tokens: int | None
    """Client's completion budget; None means the server default (capped by context)."""
    sampling: SamplingConfig
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    """``stream_options.include_usage``: send a final usage chunk when streaming."""
    n: int = 1
    """Choices to generate from the one prompt."""
    logprobs: int | None = None
    """Alternatives per token to report with each token's log-probability; None: none."""
    echo: bool = False
    """Completions: the prompt is part of the returned text (and of the logprobs)."""
    constraint: OutputConstraint | None = None
    """What the output must match (grammar, JSON Schema, any JSON object), if anything."""
    speculative: bool = True
    """``"speculative": false`` keeps drafts off this request's decoding."""


@dataclass(frozen=True, slots=True)
class CompletionParams:
    """A parsed ``POST /v1/completions`` body."""

    prompt: str | tuple[int, ...]
    """Prompt text, or token ids sent by the client."""
    params: GenerationParams

    def anon_repr(self) -> str:
        """Describe the request for logs without its prompt."""
        kind = "text" if isinstance(self.prompt, str) else "tokens"
        return f"CompletionParams(prompt=<{kind}:{len(self.prompt)}>, params={self.params})"


@dataclass(frozen=True, slots=True)
class ChatParams:
    """A parsed ``POST /v1/chat/completions`` body."""

    messages: tuple[dict[str, Any], ...]
    """``{"role", "content"}`` pairs with content flattened to text (tool calls and
    tool-call ids kept)."""
    params: GenerationParams
    tools: ToolSpec | None = None
    template_kwargs: dict[str, Any] | None = None
    """``chat_template_kwargs``: extra variables for the chat template."""

    def anon_repr(self) -> str:
        """Describe the request for logs without its messages."""
        return f"ChatParams(messages=<{len(self.messages)}>, params={self.params})"


def parse_completion_request(
    body: Any, limits: HttpLimits, *, n_vocab: int | None = None,
    defaults: SamplingConfig = DEFAULT_SAMPLING,
) -> CompletionParams:
    """Validate a completions body.

    Args:
        body: The decoded JSON body.
        limits: HTTP limits to enforce.
        n_vocab: Vocabulary size for token-id checks (prompt ids, logit_bias), if known.
        defaults: Sampling values of fields the client leaves out.

    Returns:
        The typed parameters.

    Raises:
        ApiError: 400 naming the first bad or unsupported field.
    """
    body = _require_object(body)
    reject_unsupported(body, chat=False)
    prompt = parse_prompt(body.get("prompt"), n_vocab)
    params = _parse_generation(body, limits, n_vocab, defaults, chat=False)
    best_of = check_choice_count(body, "best_of", limits.max_choices)
    if best_of != 1 and best_of != params.n:
        raise invalid_field("best_of", f"only best_of == n is supported (got {best_of}, "
                            f"n={params.n}): choices are not ranked")
    return CompletionParams(prompt=prompt, params=params)


def parse_chat_request(
    body: Any, limits: HttpLimits, *, n_vocab: int | None = None,
    defaults: SamplingConfig = DEFAULT_SAMPLING,
) -> ChatParams:
    """Validate a chat-completions body.

    Args:
        body: The decoded JSON body.
        limits: HTTP limits to enforce.
        n_vocab: Vocabulary size for logit_bias checks, if known.
        defaults: Sampling values of fields the client leaves out.

    Returns:
        The typed parameters.

    Raises:
        ApiError: 400 naming the first bad or unsupported field.
    """
    body = _require_object(body)
    reject_unsupported(body, chat=True)
    messages = parse_messages(body.get("messages"))
    params = _parse_generation(body, limits, n_vocab, defaults, chat=True)
    tools = parse_tools(body)
    if tools is not None and tools.choice != "none" and params.constraint is not None:
        raise invalid_field(params.constraint.param.split(".")[0],
                            "cannot be combined with tools unless tool_choice is 'none'")
    return ChatParams(messages=messages, params=params, tools=tools,
                      template_kwargs=_parse_template_kwargs(body.get("chat_template_kwargs")))


def _parse_template_kwargs(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_field("chat_template_kwargs", "must be an object")
    reserved = sorted(_TEMPLATE_RESERVED & value.keys())
    if reserved:
        raise invalid_field(f"chat_template_kwargs.{reserved[0]}",
                            "is set by the server and cannot be overridden")
    return dict(value)


def find_invalid_text(body: Any) -> str | None:
    """The path of the first string, key or value, that is not valid Unicode text.

    JSON may spell lone UTF-16 surrogates (``"\\ud800"``); Python decodes them into
    strings that cannot be encoded, tokenized or echoed back, so a body carrying one is
    refused up front, naming where it is.

    Returns:
        A field path such as ``messages[0].content``, or None when all text is valid.
    """
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:  # iterative: a deeply nested body must not exhaust the stack
        path, value = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                name = key if _is_text(key) else key.encode("utf-8", "backslashreplace").decode()
                child = f"{path}.{name}" if path else name
                if name is not key:
                    return f"{child} (the key)"
                stack.append((child, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def _is_text(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_body")
    return body


# -- scalar fields ---------------------------------------------------------------------

def _opt_int(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise invalid_field(name, f"must be an integer (got {type(value).__name__})")
    if value < lo or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"within [{lo}, {hi}]"
        raise invalid_field(name, f"must be {bounds} (got {value})")
    return value


def _opt_number(
    body: dict[str, Any], name: str, lo: float | None = None, hi: float | None = None
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise invalid_field(name, f"must be a finite number (got {value!r})")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        low = "-inf" if lo is None else lo
        high = "inf" if hi is None else hi
        raise invalid_field(name, f"must be within [{low}, {high}] (got {value})")
    return float(value)


def _opt_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise invalid_field(name, f"must be a boolean (got {type(value).__name__})")
    return value


# -- generation parameters -------------------------------------------------------------

def _parse_generation(
    body: dict[str, Any], limits: HttpLimits, n_vocab: int | None,
    defaults: SamplingConfig, *, chat: bool,
) -> GenerationParams:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid_field("model", "must be a string")
    stream = bool(_opt_bool(body, "stream"))
    echo = False if chat else bool(_opt_bool(body, "echo"))
    max_tokens = _parse_max_tokens(body, limits, allow_zero=echo)
    return GenerationParams(
        max_tokens=max_tokens,
        sampling=_parse_sampling(body, limits, n_vocab, defaults),
        stop=_parse_stop(body.get("stop"), limits),
        stream=stream,
        include_usage=_parse_stream_options(body.get("stream_options")),
        n=check_choice_count(body, "n", limits.max_choices),
        logprobs=_parse_chat_logprobs(body) if chat else _parse_completion_logprobs(body),
        echo=echo,
        constraint=parse_constraint(body),
        speculative=_opt_bool(body, "speculative") is not False,
    )


def _parse_chat_logprobs(body: dict[str, Any]) -> int | None:
    wanted = _opt_bool(body, "logprobs")
    top = _opt_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not wanted:
        raise invalid_field("top_logprobs", "needs logprobs: true")
    return (top or 0) if wanted else None


def _parse_completion_logprobs(body: dict[str, Any]) -> int | None:
    return _opt_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)


def _parse_max_tokens(body: dict[str, Any], limits: HttpLimits, *,
                      allow_zero: bool = False) -> int | None:
    # NOTE: max_completion_tokens is the current OpenAI name; it wins when both are sent.
    # max_tokens 0 only makes sense with echo: score the prompt, generate nothing.
    chosen = None
    for name in ("max_tokens", "max_completion_tokens"):
        value = _opt_int(body, name, 0 if allow_zero else 1)
        if value is None:
            continue
        if value > limits.max_tokens_limit:
            raise invalid_field(
                name, f"{value} exceeds the limit max_tokens_limit={limits.max_tokens_limit}"
            )
        chosen = value
    return chosen


def _parse_sampling(
    body: dict[str, Any], limits: HttpLimits, n_vocab: int | None, defaults: SamplingConfig
) -> SamplingConfig:
    top_k = _opt_int(body, "top_k", -1, _MAX_INT32)
    seed = _opt_int(body, "seed", -1, _MAX_SEED)
    last_n = _opt_int(body, "repeat_last_n", -1, limits.max_prompt_tokens + limits.max_tokens_limit)

    def pick(value: float | None, default: float) -> float:
        return default if value is None else value

    return SamplingConfig(
        temperature=pick(_opt_number(body, "temperature", 0.0), defaults.temperature),
        top_k=defaults.top_k if top_k is None else max(top_k, 0),
        top_p=pick(_opt_number(body, "top_p", 0.0, 1.0), defaults.top_p),
        min_p=pick(_opt_number(body, "min_p", 0.0, 1.0), defaults.min_p),
        typical_p=pick(_opt_number(body, "typical_p", 0.0, 1.0), defaults.typical_p),
        penalty_last_n=defaults.penalty_last_n if last_n is None else last_n,
        repeat_penalty=_parse_repeat_penalty(body, defaults.repeat_penalty),
        presence_penalty=pick(
            _opt_number(body, "presence_penalty", *_PENALTY_RANGE), defaults.presence_penalty
        ),
        frequency_penalty=pick(
            _opt_number(body, "frequency_penalty", *_PENALTY_RANGE), defaults.frequency_penalty
        ),
        seed=None if seed is None or seed < 0 else seed,
        logit_bias=_parse_logit_bias(body.get("logit_bias"), limits, n_vocab),
        ignore_eos=bool(_opt_bool(body, "ignore_eos")),
    )


def _parse_repeat_penalty(body: dict[str, Any], default: float) -> float:
    value = _opt_number(body, "repeat_penalty", 0.0)
    if value is None:
        return default
    if value <= 0.0:
        raise invalid_field("repeat_penalty", f"must be > 0 (got {value})")
    return value


def _parse_stop(value: Any, limits: HttpLimits) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid_field("stop", "must be a string or a list of strings")
    if len(stops) > limits.max_stop_strings:
        raise invalid_field(
            "stop",
            f"{len(stops)} stop strings exceed the limit max_stop_strings="
            f"{limits.max_stop_strings}",
        )
    for stop in stops:
        if not stop:
            raise invalid_field("stop", "stop strings must not be empty")
        if len(stop) > limits.max_stop_length:
            raise invalid_field(
                "stop",
                f"a stop string of {len(stop)} characters exceeds the limit max_stop_length="
                f"{limits.max_stop_length}",
            )
    return tuple(stops)


def _parse_logit_bias(
    value: Any, limits: HttpLimits, n_vocab: int | None
) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid_field("logit_bias", "must be an object mapping token ids to biases")
    if len(value) > limits.max_logit_bias:
        raise invalid_field(
            "logit_bias",
            f"{len(value)} entries exceed the limit max_logit_bias={limits.max_logit_bias}",
        )
    entries = []
    for key, bias in value.items():
        if not _TOKEN_ID_KEY.fullmatch(key) or (n_vocab is not None and int(key) >= n_vocab):
            vocab = "" if n_vocab is None else f" below {n_vocab}"
            raise invalid_field("logit_bias", f"key {key!r} is not a token id{vocab}")
        entries.append((int(key), _parse_bias(key, bias)))
    return tuple(sorted(entries))


def _parse_bias(key: str, bias: Any) -> float:
    low, high = _BIAS_RANGE
    is_number = isinstance(bias, int | float) and not isinstance(bias, bool)
    if not is_number or not math.isfinite(bias) or not low <= bias <= high:
        raise invalid_field(
            "logit_bias", f"bias for token {key} must be a number within [{low}, {high}]"
        )
    return float(bias)


def _parse_stream_options(value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, dict):
        raise invalid_field("stream_options", "must be an object")
    include = value.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise invalid_field("stream_options.include_usage", "must be a boolean")
    return bool(include)
