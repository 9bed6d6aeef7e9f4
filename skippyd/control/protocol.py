"""Control protocol v1: the wire format shared by the control socket and its clients.

Newline-delimited JSON over a Unix stream socket; every message is one JSON object with
``"v": 1`` (``docs/control-protocol.md`` is the full specification). This module holds
what both sides need: the limits, the encoder, the message builders, request validation
and a line reader that never buffers an over-long line whole. No sockets are opened here.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from skippyd.engine.worker.telemetry import TelemetryEvent

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
#: Longest request line the server accepts, newline excluded.
MAX_LINE_BYTES = 64 * 1024
DEFAULT_INTERVAL_MS = 1000
MIN_INTERVAL_MS = 100
MAX_INTERVAL_MS = 60_000
MAX_FILTER_PATTERNS = 64
OPS = ("status", "subscribe", "events", "unsubscribe")
#: Error codes of ``error`` lines.
ERROR_CODES = ("bad_json", "bad_request", "unknown_op", "unsupported_version",
               "line_too_long", "internal", "too_many_connections")


class ProtocolError(Exception):
    """A request the server answers with an ``error`` line."""

    def __init__(self, code: str, message: str, req_id: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.req_id = code, message, req_id


def _json_default(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)


def encode(message: Mapping[str, Any]) -> bytes:
    """One protocol line: compact JSON plus a newline."""
    return json.dumps(message, separators=(",", ":"), default=_json_default).encode() + b"\n"


def error_message(code: str, text: str, req_id: Any = None) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": req_id, "type": "error",
            "error": {"code": code, "message": text}}


def event_message(event: TelemetryEvent) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "event",
            "event": {"name": event.name, "ts": event.timestamp_s, "level": event.level,
                      "attributes": dict(event.attributes)}}


@dataclass(frozen=True, slots=True)
class ControlRequest:
    """A validated client request."""

    req_id: Any
    op: str
    interval_ms: int | None = None
    """Snapshot period of ``subscribe``; None for ``events`` (no snapshots)."""
    events: bool = False
    patterns: tuple[str, ...] = ()


def parse_request(line: bytes) -> ControlRequest:
    """Decode and validate one request line.

    Raises:
        ProtocolError: With the code and message of the error line to send.
    """
    try:
        data = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("bad_json", f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError("bad_request", "a request must be a JSON object")
    req_id = data.get("id")
    if isinstance(req_id, bool) or not isinstance(req_id, int | str | None):
        raise ProtocolError("bad_request", "id: must be an integer, a string or null")
    if data.get("v") != PROTOCOL_VERSION or isinstance(data.get("v"), bool):
        got = f"got {json.dumps(data['v'])}" if "v" in data else "it is missing"
        raise ProtocolError("unsupported_version",
                            f"v: this server speaks protocol version 1 ({got})", req_id)
    op = data.get("op")
    if not isinstance(op, str):
        raise ProtocolError("bad_request", "op: must be a string", req_id)
    if op not in OPS:
        raise ProtocolError("unknown_op", f"op: unknown {op!r}; expected one of "
                            + ", ".join(OPS), req_id)
    if op == "subscribe":
        return ControlRequest(req_id, op, _interval(data, req_id), _flag(data, "events", req_id),
                       _patterns(data, req_id))
    if op == "events":
        return ControlRequest(req_id, op, None, True, _patterns(data, req_id))
    return ControlRequest(req_id, op)


def _interval(data: dict[str, Any], req_id: Any) -> int:
    value = data.get("interval_ms", DEFAULT_INTERVAL_MS)
    if isinstance(value, bool) or not isinstance(value, int) or not (
            MIN_INTERVAL_MS <= value <= MAX_INTERVAL_MS):
        raise ProtocolError("bad_request", f"interval_ms: must be an integer from "
                            f"{MIN_INTERVAL_MS} to {MAX_INTERVAL_MS} (got {value!r})", req_id)
    return value


def _flag(data: dict[str, Any], key: str, req_id: Any) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise ProtocolError("bad_request", f"{key}: must be true or false", req_id)
    return value


def _patterns(data: dict[str, Any], req_id: Any) -> tuple[str, ...]:
    value = data.get("filter")
    if value is None:
        return ()
    if (not isinstance(value, list) or len(value) > MAX_FILTER_PATTERNS
            or not all(isinstance(p, str) for p in value)):
        raise ProtocolError("bad_request", f"filter: must be a list of at most "
                            f"{MAX_FILTER_PATTERNS} glob patterns (strings)", req_id)
    return tuple(value)


async def read_lines(reader: asyncio.StreamReader) -> AsyncIterator[bytes | None]:
    """Yield request lines; None stands for a line over :data:`MAX_LINE_BYTES`.

    An over-long line is discarded up to its newline without being buffered whole.
    """
    buffer = bytearray()
    discarding = False
    while chunk := await reader.read(65536):
        for index, piece in enumerate(chunk.split(b"\n")):
            if index > 0:  # a newline ended the line before this piece
                if not discarding:
                    yield bytes(buffer)
                buffer.clear()
                discarding = False
            if discarding:
                continue
            buffer += piece
            if len(buffer) > MAX_LINE_BYTES:
                buffer.clear()
                discarding = True
                yield None


