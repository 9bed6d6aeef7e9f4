"""ASGI middleware of the OpenAI app (a bound on requests in flight, the API key) and the
bounded reader of request bodies."""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from skippyd.http.api_errors import ApiError, invalid_field
from skippyd.http.parsing.request_params import find_invalid_text
from skippyd.throttle import ThrottledLog

if TYPE_CHECKING:
    from skippyd.http.observability.metrics import ServingMetrics

logger = logging.getLogger(__name__)


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


async def read_json_body(request: Request, max_body_bytes: int) -> Any:
    """Read and decode the JSON body, refusing bodies over ``max_body_bytes`` (413).

    Raises:
        ApiError: 413 when too large, 400 when not valid JSON or not valid Unicode
            (naming the field), 408 when the body never arrived.
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
