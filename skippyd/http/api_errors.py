"""The OpenAI error shape and the typed error every HTTP handler raises.

Every failure the API reports, before or during a generation, is an :class:`ApiError`;
it renders as ``{"error": {"message", "type", "param", "code"}}``, the OpenAI API's
error shape, so SDK clients raise their usual exception types.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)

#: OpenAI ``error.type`` per HTTP status; anything else is a server error.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error to send to the client in the OpenAI error shape.

    Attributes:
        status: HTTP status code.
        message: Human-readable text; names the offending field or limit.
        param: The request field at fault, or None.
        code: A short machine-readable code, or None.
        headers: Extra response headers (``Retry-After`` for 429).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def error_type(self) -> str:
        """The OpenAI ``error.type`` string for this status."""
        if self.status in _TYPE_BY_STATUS:
            return _TYPE_BY_STATUS[self.status]
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def to_body(self) -> dict[str, Any]:
        """Return the ``{"error": {...}}`` body."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> JSONResponse:
        """Return a JSON response carrying this error and its headers."""
        return JSONResponse(self.to_body(), status_code=self.status, headers=self.headers)


def invalid_field(param: str, message: str) -> ApiError:
    """Build a 400 for one request field; the message is prefixed with the field name.

    Args:
        param: Field path, e.g. ``"stop"`` or ``"messages[2].content"``.
        message: What is wrong with it.

    Returns:
        The error (the caller raises it).
    """
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def unsupported_field(param: str, detail: str) -> ApiError:
    """Build a 400 for an option this server does not implement."""
    return ApiError(
        400, f"{param}: {detail} is not supported by this server", param=param,
        code="unsupported_parameter",
    )
