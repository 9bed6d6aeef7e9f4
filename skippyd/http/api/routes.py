"""The OpenAI-compatible HTTP API: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, ``/health`` and the utility endpoints (``/tokenize``,
``/detokenize``, ``/apply-template``, ``/props``).

Handlers parse and validate the body (:mod:`~skippyd.http.parsing.request_params`),
render and tokenize the prompt and compile any grammar off the event loop
(:mod:`~skippyd.http.api.prepare`), check the prompt against the limits and the
context, submit one generation per choice to the backend and turn their text into a
JSON body or a stream of server-sent events (:mod:`~skippyd.http.shaping.choices`).
Every error uses the OpenAI error shape. A client that goes away cancels its
generations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from skippyd.engine.runtime.contract import SamplingConfig
from skippyd.http.api.prepare import (
    check_local_sampling,
    constraint_grammar,
    prepare_chat_request,
    render_chat,
)
from skippyd.http.api.utility import (
    parse_detokenize,
    parse_tokenize,
    props_body,
    tokenize_body,
)
from skippyd.http.api_errors import ApiError, invalid_field
from skippyd.http.backend import ServingBackend
from skippyd.http.guard.middleware import (
    ApiKeyMiddleware,
    ConcurrencyLimitMiddleware,
    read_json_body,
)
from skippyd.http.parsing.request_params import (
    DEFAULT_SAMPLING,
    ChatParams,
    GenerationParams,
    HttpLimits,
    parse_chat_request,
    parse_completion_request,
)
from skippyd.http.shaping.choices import Choice, Shaping, complete_response, stream_events
from skippyd.http.shaping.generation import GenerationStream
from skippyd.http.shaping.sse import EventStreamResponse, ResponseShape

if TYPE_CHECKING:
    from skippyd.http.observability.metrics import ServingMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")
#: What a completion or chat request is turned into before it is submitted: how its output
#: is shaped, its prompt tokens, its parameters, the field the prompt came in, its grammar.
_Prepared = tuple[Shaping, list[int], GenerationParams, str, str | None]
#: Threads that tokenize long prompts and render long chats.
TEXT_THREADS = 2
#: Texts of at most this many characters are tokenized (chats rendered) on the event
#: loop: a short text takes less time there than the round trip through the pool on a
#: machine whose cores llama.cpp keeps busy. The work is Python (or a ctypes call)
#: either way and holds the GIL, so the pool only pays for itself when a text is long.
INLINE_TEXT_CHARS = 2048

#: Seconds without output after which a stream sends an SSE keep-alive comment.
KEEP_ALIVE_INTERVAL_S = 10.0
#: Routes reachable without the API key.
DEFAULT_PUBLIC_PATHS = frozenset({"/health"})


def create_app(
    backend: ServingBackend,
    *,
    api_key: str | None = None,
    limits: HttpLimits | None = None,
    default_max_tokens: int | None = None,
    sampling_defaults: SamplingConfig = DEFAULT_SAMPLING,
    reasoning: bool = True,
    extra_routes: Sequence[BaseRoute] = (),
    public_paths: Collection[str] = DEFAULT_PUBLIC_PATHS,
    max_concurrent_requests: int | None = None,
    metrics: ServingMetrics | None = None,
) -> Starlette:
    """Build the OpenAI-compatible Starlette app over ``backend``.

    Args:
        backend: What serves generations.
        api_key: When set, every route outside ``public_paths`` needs
            ``Authorization: Bearer <api_key>``.
        limits: Per-request limits; defaults to :class:`HttpLimits` ().
        default_max_tokens: Completion budget when the client sends none (capped by the
            room left in the context); None generates until the end or a full context.
        sampling_defaults: Sampling of fields a request leaves out.
        reasoning: Return ``<think>`` text as ``reasoning_content`` (else as content).
        extra_routes: More routes to serve (e.g. ``/metrics``), behind the same key.
        public_paths: Paths that skip the API key check.
        max_concurrent_requests: Requests in flight beyond which new ones get 429.
        metrics: Records each generation's lifecycle and every refused request.

    Raises:
        ValueError: ``default_max_tokens`` is not positive.
    """
    if default_max_tokens is not None and default_max_tokens <= 0:
        raise ValueError(f"default_max_tokens: must be > 0 (got {default_max_tokens})")
    api = OpenAiApi(backend, limits or HttpLimits(), default_max_tokens, metrics,
                    sampling_defaults=sampling_defaults, reasoning=reasoning)
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/apply-template", api.apply_template, methods=["POST"]),
        Route("/props", api.props, methods=["GET"]),
        *extra_routes,
    ]
    middleware = []
    if max_concurrent_requests is not None:
        middleware.append(Middleware(ConcurrencyLimitMiddleware, limit=max_concurrent_requests,
                                     metrics=metrics))
    if api_key is not None:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=api_key, public_paths=public_paths,
                                     metrics=metrics))
    handlers: dict[Any, Any] = {ApiError: _api_error_handler, HTTPException: _http_error_handler}
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)


class OpenAiApi:
    """Route handlers bound to one backend.

    Args:
        backend: What serves generations.
        limits: Per-request limits.
        default_max_tokens: Budget when the client sends none; None: the context's room.
        metrics: Request metrics, if recorded.
        sampling_defaults: Sampling of fields a request leaves out.
        reasoning: Split ``<think>`` text into ``reasoning_content``.
    """

    def __init__(
        self, backend: ServingBackend, limits: HttpLimits, default_max_tokens: int | None,
        metrics: ServingMetrics | None = None, *,
        sampling_defaults: SamplingConfig = DEFAULT_SAMPLING, reasoning: bool = True,
    ) -> None:
        self._backend = backend
        self._limits = limits
        self._default_max_tokens = default_max_tokens
        self._sampling_defaults = sampling_defaults
        self._reasoning = reasoning
        self._created = int(time.time())
        self._metrics = metrics
        self._text_pool = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="skippyd-text")

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 when serving, 503 with the state (and reason) otherwise."""
        status, reason = self._backend.health()
        body: dict[str, Any] = {"status": status}
        if reason:
            body["reason"] = reason
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the one model this daemon serves."""
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``."""
        model_id = request.path_params["model_id"]
        if model_id != self._backend.model_id:
            raise ApiError(404, f"model {model_id!r} not found", param="model",
                           code="model_not_found")
        return JSONResponse(self._model_object())

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        with self._backend.arriving():
            prepared = await self._prepare_completion(request)
        return await self._generate(request, *prepared)

    async def _prepare_completion(self, request: Request) -> _Prepared:
        body = await read_json_body(request, self._limits.max_body_bytes)
        self._require_ready()
        parsed = parse_completion_request(body, self._limits, n_vocab=self._backend.n_vocab,
                                          defaults=self._sampling_defaults)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("completion request %s", parsed.anon_repr())
        params = parsed.params
        check_local_sampling(self._backend, logprobs=params.logprobs is not None,
                             **{_constraint_name(params): params.constraint is not None})
        grammar = None
        if params.constraint is not None:
            grammar = await self._off_loop(constraint_grammar, self._backend, params.constraint)
        if isinstance(parsed.prompt, str):
            tokens = await self._text_work(_short(parsed.prompt), self._backend.tokenize,
                                           parsed.prompt, add_special=True)
        else:
            tokens = list(parsed.prompt)
        echo = None
        if params.echo:
            echo = (parsed.prompt if isinstance(parsed.prompt, str)
                    else await self._off_loop(self._backend.detokenize, tokens))
        shaping = Shaping("completion", params.logprobs, echo_text=echo,
                          prompt_tokens=tuple(tokens), score_only=params.max_tokens == 0)
        return shaping, tokens, params, "prompt", grammar

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        with self._backend.arriving():
            prepared = await self._prepare_chat(request)
        return await self._generate(request, *prepared)

    async def _prepare_chat(self, request: Request) -> _Prepared:
        body = await read_json_body(request, self._limits.max_body_bytes)
        self._require_ready()
        parsed = parse_chat_request(body, self._limits, n_vocab=self._backend.n_vocab,
                                    defaults=self._sampling_defaults)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("chat request %s", parsed.anon_repr())
        params, tools = parsed.params, parsed.tools
        check_local_sampling(self._backend, logprobs=params.logprobs is not None,
                             tool_choice=tools is not None and tools.forced,
                             **{_constraint_name(params): params.constraint is not None})
        prepared = await self._text_work(_short_chat(parsed), prepare_chat_request,
                                         self._backend, parsed)
        shaping = Shaping("chat", params.logprobs, tools=tools, tool_format=prepared.tool_format,
                          reasoning_open=prepared.reasoning_open if self._reasoning else None)
        return shaping, prepared.tokens, params, "messages", prepared.grammar

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize`` (llama-server's shape)."""
        body = await read_json_body(request, self._limits.max_body_bytes)
        self._require_ready()
        content, add_special, parse_special, with_pieces = parse_tokenize(body)
        tokens = await self._text_work(_short(content), self._backend.tokenize, content,
                                       add_special=add_special, parse_special=parse_special)
        return JSONResponse(tokenize_body(self._backend, tokens, with_pieces))

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize`` (llama-server's shape)."""
        body = await read_json_body(request, self._limits.max_body_bytes)
        self._require_ready()
        tokens = parse_detokenize(body, self._backend.n_vocab)
        return JSONResponse({"content": await self._off_loop(self._backend.detokenize, tokens)})

    async def apply_template(self, request: Request) -> Response:
        """``POST /apply-template``: the chat's prompt text, as a chat request would render it."""
        body = await read_json_body(request, self._limits.max_body_bytes)
        self._require_ready()
        parsed = parse_chat_request(body, self._limits, n_vocab=self._backend.n_vocab,
                                    defaults=self._sampling_defaults)
        text, _ = await self._off_loop(render_chat, self._backend, parsed)
        return JSONResponse({"prompt": text})

    async def props(self, request: Request) -> Response:
        """``GET /props`` (llama-server's shape, plus the stage's layer range)."""
        self._require_ready()
        return JSONResponse(props_body(self._backend, self._sampling_defaults,
                                       self._default_max_tokens))

    async def _text_work(self, short: bool, fn: Callable[..., T], *args: Any,
                         **kwargs: Any) -> T:
        """Tokenize or render a text: here when it is ``short`` (``INLINE_TEXT_CHARS``),
        else on the text pool."""
        if short:
            return fn(*args, **kwargs)
        return await self._off_loop(fn, *args, **kwargs)

    async def _off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run tokenization off the event loop, on a small pool of its own.

        NOTE: a fixed pool instead of Starlette's shared one keeps the daemon's thread
        count constant (AnyIO's workers linger until the next call) and bounds how many
        prompts are tokenized at once.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._text_pool, functools.partial(fn, *args, **kwargs))

    def _model_object(self) -> dict[str, Any]:
        facts = self._backend.describe()
        return {
            "id": self._backend.model_id,
            "object": "model",
            "created": self._created,
            "owned_by": "skippyd",
            "max_model_len": self._backend.max_context_tokens,
            "meta": {"n_ctx": self._backend.max_context_tokens,
                     "layer_start": facts.get("layer_start"),
                     "layer_end": facts.get("layer_end"), "n_layer": facts.get("n_layer")},
        }

    def _require_ready(self) -> None:
        status, reason = self._backend.health()
        if status != "ok":
            if self._metrics is not None:
                self._metrics.record_rejection("unavailable")
            detail = f": {reason}" if reason else ""
            # A degraded pipeline is reconnecting (within seconds): worth retrying soon.
            headers = {"Retry-After": "1"} if status == "degraded" else None
            raise ApiError(503, f"server is {status}{detail}", code=status, headers=headers)

    def _budget(self, num_prompt_tokens: int, requested: int | None,
                prompt_param: str) -> tuple[int, tuple[int, int] | None]:
        """The completion budget, and (requested, granted) when it had to be clamped.

        Raises:
            ApiError: 400 when the prompt is empty, over the limit or fills the context.
        """
        ctx = self._backend.max_context_tokens
        if num_prompt_tokens == 0:
            raise invalid_field(prompt_param, "the prompt is empty after tokenization")
        if num_prompt_tokens > self._limits.max_prompt_tokens:
            raise invalid_field(
                prompt_param,
                f"the prompt has {num_prompt_tokens} tokens, over the limit "
                f"max_prompt_tokens={self._limits.max_prompt_tokens}",
            )
        if num_prompt_tokens >= ctx:
            raise ApiError(
                400, f"the prompt has {num_prompt_tokens} tokens but the context size is {ctx} "
                "tokens; shorten the prompt", param=prompt_param, code="context_length_exceeded",
            )
        room = ctx - num_prompt_tokens
        if requested is None:
            return min(self._default_max_tokens or room, room), None
        if requested > room:
            logger.info("max_tokens %d clamped to the %d tokens left in the context",
                        requested, room)
            return room, (requested, room)
        return max(requested, 1), None  # 0 (echo): one token is computed, none returned

    def _check_choice_lanes(self, n: int) -> None:
        """Refuse more choices than lanes: they decode side by side, one lane each.

        Raises:
            ApiError: 400 naming ``n``.
        """
        if n == 1:
            return
        lanes = self._backend.describe().get("lane_count")
        if isinstance(lanes, int) and n > lanes:
            raise invalid_field("n", f"{n} choices exceed the {lanes} lanes of this stage "
                                "(runtime.lane_count): each choice decodes in a lane of its own")

    async def _generate(self, request: Request, shaping: Shaping, tokens: list[int],
                        params: GenerationParams, prompt_param: str,
                        grammar: str | None) -> Response:
        self._check_choice_lanes(params.n)
        max_tokens, clamp = self._budget(len(tokens), params.max_tokens, prompt_param)
        prefix = "chatcmpl" if shaping.kind == "chat" else "cmpl"
        shape = ResponseShape(
            kind=shaping.kind,
            response_id=f"{prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self._backend.model_id,
            usage_in_chunks=params.stream and params.include_usage,
        )
        choices = self._start_choices(shape.response_id, shaping, tokens, max_tokens, params,
                                      grammar)

        def close() -> None:
            for choice in choices:
                choice.stream.close()

        if params.stream:
            events = stream_events(choices, shape, params.include_usage, clamp,
                                   KEEP_ALIVE_INTERVAL_S)
            return EventStreamResponse(events, close)
        try:
            return await complete_response(request, choices, shape, clamp)
        finally:
            close()

    def _start_choices(self, response_id: str, shaping: Shaping, tokens: list[int],
                       max_tokens: int, params: GenerationParams,
                       grammar: str | None) -> list[Choice]:
        """Submit one generation per choice; the later ones copy the first one's prompt."""
        base = dataclasses.replace(
            params.sampling, grammar=grammar, logprobs=params.logprobs,
            prompt_logprobs=params.logprobs if shaping.echo_text is not None else None)
        choices: list[Choice] = []
        try:
            for index in range(params.n):
                sampling = base if index == 0 else _later_choice(base, index)
                request_id = response_id if index == 0 else f"{response_id}-{index}"
                stream = GenerationStream(
                    self._backend, request_id, tokens, max_tokens, params, self._metrics,
                    sampling=sampling, fork_of=None if index == 0 else response_id)
                stream.start()
                choices.append(Choice(index, stream, shaping, self._backend,
                                      choices[0] if choices else None))
        except ApiError:
            for choice in choices:
                choice.stream.close()
            raise
        return choices


def _short(text: str) -> bool:
    return len(text) <= INLINE_TEXT_CHARS


def _short_chat(parsed: ChatParams) -> bool:
    """Whether preparing the chat handles little text; a chat with tools or an output
    constraint also builds a grammar, which always goes to the pool."""
    if parsed.tools is not None or parsed.params.constraint is not None:
        return False
    chars = sum(len(str(value)) for message in parsed.messages for value in message.values()
                ) + sum(len(str(value)) for value in (parsed.template_kwargs or {}).values())
    return chars <= INLINE_TEXT_CHARS


def _later_choice(base: SamplingConfig, index: int) -> SamplingConfig:
    """Choice ``index``'s sampling: its own seed, and no prompt work of its own."""
    seed = None if base.seed is None else (base.seed + index) % 2**64
    return dataclasses.replace(base, seed=seed, prompt_logprobs=None)


def _constraint_name(params: GenerationParams) -> str:
    constraint = params.constraint
    return "response_format" if constraint is None else constraint.param.split(".")[0]


async def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.to_response()


async def _http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    return error.to_response()
