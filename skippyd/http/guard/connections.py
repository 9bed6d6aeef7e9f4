"""Connection-level limits for the HTTP port: deadlines, a cap, and who gives way.

uvicorn closes only a connection that stays silent after a response: one that never
sends a byte, or drips one every few seconds, would hold its socket forever.
:func:`guarded_protocol` wraps the configured uvicorn protocol class (h11 or httptools)
so that a connection is always under exactly one absolute deadline, by :class:`Phase`:
its head, its body, or, while the app answers (a generation may be long), a client that
stops reading. Bytes never extend a deadline, and timers change only with the phase,
never per chunk of response. Beyond ``max_open_connections`` a new connection replaces
the one that has waited longest for a head, so idle connections never lock out a health
probe. README.md, *Exposing it: keys, connections, hostile clients*, has the keys.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import resource
from dataclasses import dataclass
from typing import Any

from skippyd.throttle import ThrottledLog

logger = logging.getLogger(__name__)
_throttled = ThrottledLog(logger)

#: File descriptors kept for everything that is not an HTTP connection (model, link,
#: control socket, logs, the text pool...).
RESERVED_FDS = 256
_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\n"
                    b"content-length: 0\r\n\r\n")
_HEAD_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
                   b"content-length: 0\r\n\r\n")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one connection may take; config ``[http]`` keys of the same names."""

    header_timeout_s: float = 60.0
    """A new connection must deliver a complete request head within this time."""
    body_timeout_s: float = 60.0
    """The whole request body must arrive within this time of its head."""
    keep_alive_timeout_s: float = 75.0
    """An idle keep-alive connection must start (and finish) its next head in time."""
    send_timeout_s: float = 60.0
    """A client may leave the response unread (its buffer full) this long."""
    max_open_connections: int = 1024
    """Open connections at most; beyond it the longest-waiting idle one gives way."""
    max_head_bytes: int = 64 * 1024
    """Largest request head (request line and headers)."""

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s",
                     "send_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 (got {getattr(self, name)})")
        if self.max_open_connections < 1 or self.max_head_bytes < 1:
            raise ValueError("max_open_connections and max_head_bytes: must be >= 1")


class Phase(enum.Enum):
    """Which deadline a connection is under."""

    WAITING = "waiting for a request head"
    BODY = "reading a request body"
    APP = "handled by the app"


class ConnectionGuard:
    """The state all connections of one server share: limits, the open set, counters.

    Only the event loop thread touches it.
    """

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open: set[Any] = set()
        # Insertion-ordered: the first key has waited longest for a request head.
        self._waiting: dict[Any, None] = {}
        self.counters = dict.fromkeys(
            ("accepted", "evicted", "refused", "header_timeouts", "body_timeouts",
             "send_timeouts", "heads_too_large"), 0)

    def admit(self, conn: Any) -> bool:
        """Register a new connection, making room if needed; False means close it."""
        if len(self.open) >= self.limits.max_open_connections:
            if not self._waiting:
                self.counters["refused"] += 1
                _throttled.warning("refused", "HTTP connection from %s refused: %d "
                                   "connections open, all busy (http.max_open_connections)",
                                   _peer(conn), len(self.open))
                return False
            victim = next(iter(self._waiting))
            self.forget(victim)
            self.counters["evicted"] += 1
            _throttled.info("evicted", "closed idle HTTP connection from %s to admit a new "
                            "one (http.max_open_connections=%d reached)", _peer(victim),
                            self.limits.max_open_connections)
            victim.transport.close()
        self.open.add(conn)
        self.counters["accepted"] += 1
        return True

    def waiting(self, conn: Any, is_waiting: bool) -> None:
        """Mark ``conn`` as (not) waiting for a request head: only those may be evicted."""
        if is_waiting:
            self._waiting.pop(conn, None)
            self._waiting[conn] = None
        else:
            self._waiting.pop(conn, None)

    def forget(self, conn: Any) -> None:
        """Drop a closed (or closing) connection. Idempotent."""
        self.open.discard(conn)
        self._waiting.pop(conn, None)

    def expired(self, conn: Any, counter: str, what: str, limit_s: float) -> None:
        self.counters[counter] += 1
        _throttled.info(counter, "closed HTTP connection from %s: %s not done within %.0f s",
                        _peer(conn), what, limit_s)


def _peer(conn: Any) -> str:
    client = getattr(conn, "client", None)
    return f"{client[0]}:{client[1]}" if client else "?"


class _GuardedConnection:
    """Mixin over a uvicorn HTTP protocol class; see the module docstring.

    Relies on what both uvicorn implementations share: ``transport``, ``cycle`` (with
    ``more_body`` and ``response_complete``), ``on_response_complete`` and the
    ``pause_writing``/``resume_writing`` transport callbacks.
    """

    guard: ConnectionGuard
    transport: asyncio.Transport
    cycle: Any
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._phase_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._tracked_cycle: Any = None
        self._head_bytes = 0
        self._phase = Phase.WAITING
        if not self.guard.admit(self):
            transport.close()
            return
        self._wait_for_head(self.guard.limits.header_timeout_s, "header_timeouts")

    def data_received(self, data: bytes) -> None:
        waiting = self._phase is Phase.WAITING
        super().data_received(data)  # type: ignore[misc]
        self._follow_cycle()
        if waiting and self._phase is Phase.WAITING:
            # Still no complete head after these bytes (a body sent along with its head
            # has moved the phase on, and is not counted).
            self._head_bytes += len(data)
            if self._head_bytes > self.guard.limits.max_head_bytes:
                self.guard.counters["heads_too_large"] += 1
                self._abort(_HEAD_TOO_LARGE)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            self._follow_cycle()  # a pipelined request started
        else:
            self._tracked_cycle = cycle
            self._wait_for_head(self.guard.limits.keep_alive_timeout_s, "header_timeouts")

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._send_timer is None:
            limit = self.guard.limits.send_timeout_s
            self._send_timer = self.loop.call_later(
                limit, self._expire, "send_timeouts", "reading the response", limit)

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._phase_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._phase_timer = self._send_timer = None
        self.guard.forget(self)
        super().connection_lost(exc)  # type: ignore[misc]

    # -- phases -------------------------------------------------------------------------

    def _follow_cycle(self) -> None:
        """Move to the phase the newest request cycle is in (after data or a response)."""
        cycle = self.cycle
        if cycle is None or self.transport.is_closing():
            return
        if cycle is not self._tracked_cycle:
            self._tracked_cycle = cycle
            if cycle.more_body:
                self._set_phase(Phase.BODY, self.guard.limits.body_timeout_s, "body_timeouts")
            else:
                self._set_phase(Phase.APP, None, "")
        elif self._phase is Phase.BODY and not cycle.more_body:
            self._set_phase(Phase.APP, None, "")

    def _wait_for_head(self, limit_s: float, counter: str) -> None:
        self._head_bytes = 0
        self._set_phase(Phase.WAITING, limit_s, counter)

    def _set_phase(self, phase: Phase, limit_s: float | None, counter: str) -> None:
        if self._phase_timer is not None:
            self._phase_timer.cancel()
            self._phase_timer = None
        self._phase = phase
        self.guard.waiting(self, phase is Phase.WAITING)
        if limit_s is not None:
            self._phase_timer = self.loop.call_later(limit_s, self._expire, counter,
                                                     phase.value, limit_s)

    def _expire(self, counter: str, what: str, limit_s: float) -> None:
        if self.transport.is_closing():
            return
        self.guard.expired(self, counter, what, limit_s)
        if counter == "send_timeouts":
            # NOTE: close() would wait for the unread buffer to drain, which is never.
            self.guard.forget(self)
            self.transport.abort()
            return
        # Tell a client that sent part of a head why; a silent one gets a plain close.
        waiting = self._phase is Phase.WAITING
        self._abort(_REQUEST_TIMEOUT if waiting and self._head_bytes else None)

    def _abort(self, response: bytes | None) -> None:
        self.guard.forget(self)
        if response is not None:
            self.transport.write(response)
        self.transport.close()


def guarded_protocol(base: type[asyncio.Protocol], guard: ConnectionGuard) -> type:
    """A subclass of uvicorn's HTTP protocol class ``base`` whose connections obey ``guard``."""
    name = f"Guarded{base.__name__}"
    return type(name, (_GuardedConnection, base), {"guard": guard})


def protocol_class(name: str) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class for ``"h11"``, ``"httptools"`` or ``"auto"``.

    Raises:
        ImportError: ``httptools`` was asked for but is not installed.
    """
    if name == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol
    if name == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    if name == "auto":
        from uvicorn.protocols.http.auto import AutoHTTPProtocol
        return AutoHTTPProtocol
    raise ValueError(f"unknown HTTP protocol {name!r} (expected h11, httptools or auto)")


def fit_fd_limit(max_open_connections: int) -> int:
    """Raise the soft open-files limit so the cap fits; return the cap that does fit.

    Without this, a default soft limit of 1 024 makes ``accept()`` fail with EMFILE
    long before the configured cap, and then every client is locked out.
    """
    needed = max_open_connections + RESERVED_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-files limit to %d: %s", target, exc)
    if soft != resource.RLIM_INFINITY and soft < needed:
        fitted = max(1, soft - RESERVED_FDS)
        logger.warning("http.max_open_connections=%d does not fit the open-files limit %d;"
                       " using %d (raise LimitNOFILE= or ulimit -n)", max_open_connections,
                       soft, fitted)
        return fitted
    return max_open_connections
