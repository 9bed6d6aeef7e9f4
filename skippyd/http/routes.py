"""The OpenAI-compatible HTTP API: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` and ``/health``.

Handlers parse and validate the body (:mod:`requests`), tokenize, check the prompt
against the limits and the context, submit one generation to the backend and turn its
text into a JSON body or a stream of server-sent events. Every error uses the OpenAI
error shape. A client that goes away cancels its generation.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from skippyd.http.backend import ServingBackend
from skippyd.http.errors import ApiError, invalid_field
from skippyd.http.generation import GenerationStream
from skippyd.http.requests import (
    GenerationParams,
    HttpLimits,
    find_invalid_text,
    parse_chat_request,
    parse_completion_request,
)
from skippyd.http.sse import (
    SSE_DONE,
    SSE_KEEP_ALIVE,
    EventStreamResponse,
    ResponseShape,
    make_usage,
    sse_event,
)
from skippyd.throttle import ThrottledLog

if TYPE_CHECKING:
    from skippyd.http.metrics import ServingMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")
#: Threads that tokenize prompts and render chat templates.
TEXT_THREADS = 2

#: Seconds without output after which a stream sends an SSE keep-alive comment.
KEEP_ALIVE_INTERVAL_S = 10.0
#: Routes reachable without the API key.
DEFAULT_PUBLIC_PATHS = frozenset({"/health"})


def create_app(
    backend: ServingBackend,
    *,
    api_key: str | None = None,
    limits: HttpLimits | None = None,
    default_max_tokens: int = 256,
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
            room left in the context).
        extra_routes: More routes to serve (e.g. ``/metrics``), behind the same key.
        public_paths: Paths that skip the API key check.
        max_concurrent_requests: Requests in flight beyond which new ones get 429.
        metrics: Records each generation's lifecycle and every refused request.

    Returns:
        The ASGI app.
    """
    if default_max_tokens <= 0:
        raise ValueError(f"default_max_tokens: must be > 0 (got {default_max_tokens})")
    api = OpenAiApi(backend, limits or HttpLimits(), default_max_tokens, metrics)
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
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


class ConcurrencyLimitMiddleware:
    """Bound the HTTP requests in flight; beyond it answer 429 naming the limit.

    ``/health`` is never refused, so a supervisor can still look in under load.
    """

    def __init__(self, app: ASGIApp, *, limit: int, metrics: ServingMetrics | None = None) -> None:
        if limit < 1:
            raise ValueError(f"limit: must be >= 1 (got {limit})")
        self._app = app
        self._limit = limit
        self._in_flight = 0
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self._app(scope, receive, send)
            return
        if self._in_flight >= self._limit:
            error = ApiError(429, f"too many concurrent requests: the limit max_connections="
                             f"{self._limit} is reached; retry later", code="too_many_requests")
            error.headers["Retry-After"] = "1"
            if self._metrics is not None:
                self._metrics.record_rejection("max_connections")
            await error.to_response()(scope, receive, send)
            return
        self._in_flight += 1
        try:
            await self._app(scope, receive, send)
        finally:
            self._in_flight -= 1


class ApiKeyMiddleware:
    """Reject requests without the right bearer token (401, OpenAI error shape)."""

    def __init__(self, app: ASGIApp, *, api_key: str, public_paths: Collection[str],
                 metrics: ServingMetrics | None = None) -> None:
        if not api_key:
            raise ValueError("api_key: must be a non-empty string")
        self._app = app
        self._expected = api_key.encode("utf-8")
        self._public_paths = frozenset(public_paths)
        self._metrics = metrics
        self._refusals = ThrottledLog(logger)

    def _authorized(self, scope: Scope) -> bool:
        header = Headers(scope=scope).get("authorization", "")
        scheme, _, token = header.partition(" ")
        # NOTE: headers arrive latin-1 decoded; re-encoding gives back the raw bytes.
        given = token.strip().encode("latin-1", errors="replace")
        matches = hmac.compare_digest(given, self._expected)
        return scheme.lower() == "bearer" and matches

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self._public_paths:
            if not self._authorized(scope):
                client = scope.get("client") or ("?", 0)
                self._refusals.warning("auth", "refused %s %r from %s:%s: missing or invalid API "
                                  "key", scope["method"], scope["path"][:64], *client[:2])
                error = ApiError(401, "missing or invalid API key", code="invalid_api_key")
                error.headers["WWW-Authenticate"] = "Bearer"
                if self._metrics is not None:
                    self._metrics.record_rejection("unauthorized")
                await error.to_response()(scope, receive, send)
                return
        await self._app(scope, receive, send)


class OpenAiApi:
    """Route handlers bound to one backend.

    Args:
        backend: What serves generations.
        limits: Per-request limits.
        default_max_tokens: Budget when the client sends none.
        metrics: Request metrics, if recorded.
    """

    def __init__(
        self, backend: ServingBackend, limits: HttpLimits, default_max_tokens: int,
        metrics: ServingMetrics | None = None,
    ) -> None:
        self._backend = backend
        self._limits = limits
        self._default_max_tokens = default_max_tokens
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
        body = await read_json_body(request, self._limits.max_body_bytes)
        self._require_ready()
        parsed = parse_completion_request(body, self._limits, n_vocab=self._backend.n_vocab)
        logger.debug("completion request %s", parsed.anon_repr())
        if isinstance(parsed.prompt, str):
            tokens = await self._off_loop(self._backend.tokenize, parsed.prompt,
                                          add_special=True)
        else:
            tokens = list(parsed.prompt)
        return await self._generate(request, "completion", tokens, parsed.params, "prompt")

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        body = await read_json_body(request, self._limits.max_body_bytes)
        self._require_ready()
        parsed = parse_chat_request(body, self._limits, n_vocab=self._backend.n_vocab)
        logger.debug("chat request %s", parsed.anon_repr())
        tokens = await self._off_loop(self._chat_tokens, parsed.messages)
        return await self._generate(request, "chat", tokens, parsed.params, "messages")

    async def _off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run tokenization off the event loop, on a small pool of its own.

        NOTE: a fixed pool instead of Starlette's shared one keeps the daemon's thread
        count constant (AnyIO's workers linger until the next call) and bounds how many
        prompts are tokenized at once.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._text_pool, functools.partial(fn, *args, **kwargs))

    def _chat_tokens(self, messages: tuple[dict[str, str], ...]) -> list[int]:
        """Render and tokenize a chat (runs in the thread pool: templates can be slow)."""
        try:
            return self._backend.chat_tokens([dict(m) for m in messages])
        except ValueError as exc:
            raise invalid_field("messages", f"chat template rejected the messages: {exc}") from exc

    def _model_object(self) -> dict[str, Any]:
        return {
            "id": self._backend.model_id,
            "object": "model",
            "created": self._created,
            "owned_by": "skippyd",
            "max_model_len": self._backend.ctx_size,
        }

    def _require_ready(self) -> None:
        status, reason = self._backend.health()
        if status != "ok":
            if self._metrics is not None:
                self._metrics.record_rejection("unavailable")
            detail = f": {reason}" if reason else ""
            raise ApiError(503, f"server is {status}{detail}", code=status)

    def _budget(self, num_prompt_tokens: int, requested: int | None, prompt_param: str) -> int:
        """Return the completion budget, or raise a 400 naming the limit it breaks."""
        ctx = self._backend.ctx_size
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
        if requested is None:
            return min(self._default_max_tokens, ctx - num_prompt_tokens)
        if num_prompt_tokens + requested > ctx:
            raise ApiError(
                400, f"prompt tokens ({num_prompt_tokens}) + max_tokens ({requested}) = "
                f"{num_prompt_tokens + requested} exceeds the context size ({ctx} tokens)",
                param="max_tokens", code="context_length_exceeded",
            )
        return requested

    async def _generate(
        self,
        request: Request,
        kind: Literal["chat", "completion"],
        tokens: list[int],
        params: GenerationParams,
        prompt_param: str,
    ) -> Response:
        max_tokens = self._budget(len(tokens), params.max_tokens, prompt_param)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        shape = ResponseShape(
            kind=kind,
            response_id=f"{prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self._backend.model_id,
            usage_in_chunks=params.stream and params.include_usage,
        )
        stream = GenerationStream(self._backend, shape.response_id, tokens, max_tokens, params,
                                  self._metrics)
        stream.start()
        if params.stream:
            events = _stream_events(stream, shape, params.include_usage)
            return EventStreamResponse(events, stream.close)
        try:
            return await _complete(request, stream, shape)
        finally:
            stream.close()


async def read_json_body(request: Request, max_body_bytes: int) -> Any:
    """Read and decode the JSON body, refusing bodies over ``max_body_bytes`` (413).

    Raises:
        ApiError: 413 when too large, 400 when not valid JSON.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise _body_too_large(max_body_bytes)
    chunks: list[bytes] = []
    num_bytes = 0
    try:
        async for chunk in request.stream():
            num_bytes += len(chunk)
            if num_bytes > max_body_bytes:
                raise _body_too_large(max_body_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        # The client left, or the connection guard closed it for a late body: nobody
        # reads this answer, but the handler must end without a traceback.
        raise ApiError(408, "the request body did not arrive", code="request_timeout") from None
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    invalid = find_invalid_text(body)
    if invalid is not None:
        raise invalid_field(invalid, "is not valid Unicode text (a lone UTF-16 surrogate)")
    return body


def _body_too_large(max_body_bytes: int) -> ApiError:
    return ApiError(
        413, f"request body exceeds the limit max_body_bytes={max_body_bytes}",
        code="request_too_large",
    )


def _usage(stream: GenerationStream) -> dict[str, Any]:
    return make_usage(stream.num_prompt_tokens, stream.num_completion_tokens,
                      stream.cached_tokens())


async def _stream_events(
    stream: GenerationStream, shape: ResponseShape, include_usage: bool
) -> AsyncIterator[bytes]:
    """Encode a generation as SSE events; an error mid-stream becomes an error event.

    Every wake-up sends what the generation produced since the last one in one write.
    The chat role chunk goes out with the first text, not before the prompt is
    processed (clients time the first chunk as the first token); a long wait for it
    sends keep-alive comments instead.
    """
    opening = shape.first_chunk()
    try:
        while True:
            pieces = await stream.next_pieces(KEEP_ALIVE_INTERVAL_S)
            if pieces is None:
                yield SSE_KEEP_ALIVE
                continue
            if not pieces and stream.finished:
                break
            events = [shape.text_event(piece) for piece in pieces]
            if opening is not None and events:
                events.insert(0, sse_event(opening))
                opening = None
            yield b"".join(events)
        closing = [sse_event(shape.text_chunk("", stream.finish_reason))]
        if opening is not None:
            closing.insert(0, sse_event(opening))
        if include_usage:
            closing.append(sse_event(shape.usage_chunk(_usage(stream))))
        yield b"".join(closing)
    except ApiError as exc:
        yield sse_event(exc.to_body())
    yield SSE_DONE


async def _complete(request: Request, stream: GenerationStream, shape: ResponseShape) -> Response:
    """Collect the whole text, giving up as soon as the client disconnects."""
    collect = asyncio.ensure_future(stream.collect())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collect, watcher):
            task.cancel()
        await asyncio.gather(collect, watcher, return_exceptions=True)
    if collect.cancelled():
        logger.info("client left before %s finished", stream.request_id)
        return Response(status_code=499)
    text = collect.result()
    assert stream.finish_reason is not None
    return JSONResponse(shape.full_body(text, stream.finish_reason, _usage(stream)))


async def _wait_for_disconnect(request: Request) -> None:
    # NOTE: the body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.to_response()


async def _http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    return error.to_response()
