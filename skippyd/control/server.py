"""The local control socket: status snapshots and live telemetry for ``skippyd top``.

A Unix stream socket speaking newline-delimited JSON (protocol v1, specified in
``docs/control-protocol.md``). A client may ask for one snapshot, or subscribe to
periodic snapshots and to the worker's telemetry events. Subscriptions never slow the
worker: the telemetry hub only appends to a bounded per-subscriber buffer, and each
connection keeps its own bounded outbox whose oldest events are dropped (and counted,
then reported with a ``dropped`` line) when the client reads too slowly. Bad input gets
an ``error`` line and the connection goes on.

The socket file is owner-only (0600), or 0660 with a configured group; a stale file left
by a crashed daemon is replaced, a live one is left alone (:class:`ControlSocketInUse`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import grp
import logging
import os
import socket
import stat
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from skippyd import __version__
from skippyd.control.protocol import (
    MAX_LINE_BYTES,
    PROTOCOL_VERSION,
    ControlRequest,
    ProtocolError,
    encode,
    error_message,
    event_message,
    parse_request,
    read_lines,
)
from skippyd.engine.telemetry_events import EventLevel
from skippyd.engine.worker.telemetry import Subscription, TelemetryEvent, TelemetryHub

logger = logging.getLogger(__name__)

#: Events a connection holds for a slow client before dropping the oldest.
SUBSCRIBER_BUFFER = 1024
#: Events the hub holds for a connection before the event loop collects them.
HUB_BUFFER = 4096
MAX_CONNECTIONS = 64
#: Subscribers share one snapshot computed at most this often.
SNAPSHOT_REUSE_S = 0.05
_SUN_PATH_MAX = 107


class ControlSocketError(Exception):
    """The control socket cannot be set up at its path."""


class ControlSocketInUse(ControlSocketError):
    """Another live process already listens on the control socket path."""


# -- the socket file ------------------------------------------------------------------------

def bind_control_socket(path: Path, stage_id: str, group: str | None = None) -> socket.socket:
    """Create the listening socket at ``path`` with its final permissions already set.

    The socket is bound in a private directory, given its mode (and group) there, then
    renamed into place, so it is never reachable with looser permissions.

    Raises:
        ControlSocketInUse: A live process listens at ``path``.
        ControlSocketError: The path is unusable (not a socket, no permission, no group).
    """
    gid = _group_id(group)
    _ensure_parent(path.parent, gid)
    _check_existing(path, stage_id)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _bind_in_place(sock, path, 0o600 if gid is None else 0o660, gid)
    except OSError as exc:
        sock.close()
        raise ControlSocketError(f"cannot create the control socket {path}: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def _bind_in_place(sock: socket.socket, path: Path, mode: int, gid: int | None) -> None:
    private = Path(tempfile.mkdtemp(prefix=".", dir=path.parent))
    try:
        staged = private / "s"
        if len(os.fsencode(staged)) > _SUN_PATH_MAX:
            staged = path  # NOTE: no room for the private detour; chmod right after bind
            path.unlink(missing_ok=True)
        sock.bind(str(staged))
        os.chmod(staged, mode)
        if gid is not None:
            os.chown(staged, -1, gid)
        sock.listen(128)
        if staged != path:
            os.replace(staged, path)
    finally:
        with contextlib.suppress(OSError):
            (private / "s").unlink(missing_ok=True)
            private.rmdir()


def _group_id(group: str | None) -> int | None:
    if group is None:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ControlSocketError(f"control.group: no such group {group!r}") from None


def _ensure_parent(parent: Path, gid: int | None) -> None:
    if parent.is_dir():
        return
    # With a group, its members must be able to reach the socket inside.
    mode = 0o700 if gid is None else 0o750
    try:
        parent.mkdir(mode=mode, parents=True)
        os.chmod(parent, mode)
        if gid is not None:
            os.chown(parent, -1, gid)
    except OSError as exc:
        raise ControlSocketError(f"cannot create the control socket directory {parent}: "
                                 f"{exc}") from exc


def _check_existing(path: Path, stage_id: str) -> None:
    """Return if ``path`` is free or a stale socket; raise if it is live or not a socket."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ControlSocketError(f"{path} exists and is not a socket; remove it or set "
                                 "control.socket to another path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            logger.info("replacing stale control socket %s", path)
            return
        except TimeoutError:
            pass  # listening but with a full backlog: alive
        except OSError as exc:
            raise ControlSocketError(f"cannot probe the control socket {path}: {exc}") from exc
    raise ControlSocketInUse(f"another skippyd is serving stage {stage_id} at {path}")


# -- one subscription -----------------------------------------------------------------------

class _Subscriber:
    """Periodic snapshots and/or filtered events for one connection.

    The hub delivers into a bounded :class:`Subscription` and pokes the event loop; the
    loop moves matching events into this outbox, dropping the oldest when the client is
    behind; a sender task writes them out, announcing drops first.
    """

    def __init__(self, conn: _Connection, request: ControlRequest) -> None:
        self._conn = conn
        self._loop = asyncio.get_running_loop()
        self._interval_s = None if request.interval_ms is None else request.interval_ms / 1000
        self._patterns = request.patterns
        self._matches: dict[str, bool] = {}
        self._outbox: deque[TelemetryEvent] = deque()
        self._num_dropped = 0
        self._hub_dropped = 0
        self._wake = asyncio.Event()
        self._poked = False
        self._hub: Subscription | None = None
        if request.events:
            self._hub = conn.server.telemetry.subscribe(HUB_BUFFER, self._notify,
                                                        level=conn.server.event_level)
        self.task = self._loop.create_task(self._run())

    def _notify(self) -> None:
        """Worker thread: schedule one collection, never block."""
        if self._poked:
            return
        self._poked = True
        with contextlib.suppress(RuntimeError):  # loop closed: nobody reads any more
            self._loop.call_soon_threadsafe(self._collect)

    def _collect(self) -> None:
        self._poked = False
        if self._hub is None:
            return
        events = self._hub.drain()
        lost = self._hub.num_dropped - self._hub_dropped
        self._hub_dropped += lost
        self._num_dropped += lost
        for event in events:
            if self._wanted(event.name):
                if len(self._outbox) >= SUBSCRIBER_BUFFER:
                    self._outbox.popleft()
                    self._num_dropped += 1
                self._outbox.append(event)
        if self._outbox or self._num_dropped:
            self._wake.set()

    def _wanted(self, name: str) -> bool:
        if not self._patterns:
            return True
        if name not in self._matches:
            self._matches[name] = any(fnmatch.fnmatchcase(name, p) for p in self._patterns)
        return self._matches[name]

    async def _run(self) -> None:
        deadline = self._loop.time() if self._interval_s is not None else None
        try:
            while True:
                await self._wait(deadline)
                await self._flush()
                if (deadline is not None and self._interval_s is not None
                        and self._loop.time() >= deadline):
                    await self._conn.send(self._conn.server.snapshot_message(shared=True))
                    # A slow reader gets fewer snapshots, never a backlog of them.
                    deadline = max(deadline + self._interval_s, self._loop.time())
        except OSError as exc:  # the client left; its reader side ends the connection
            logger.debug("control subscriber gone: %r", exc)

    async def _wait(self, deadline: float | None) -> None:
        if self._outbox or self._num_dropped:
            return
        self._wake.clear()
        timeout = None if deadline is None else max(0.0, deadline - self._loop.time())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _flush(self) -> None:
        for _ in range(len(self._outbox) + 1):
            if self._num_dropped:
                count, self._num_dropped = self._num_dropped, 0
                await self._conn.send({"v": PROTOCOL_VERSION, "type": "dropped", "count": count})
            if not self._outbox:
                return
            await self._conn.send(event_message(self._outbox.popleft()))

    async def close(self) -> None:
        if self._hub is not None:
            self._hub.close()
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


# -- one client connection ------------------------------------------------------------------

class _Connection:
    """Reads requests and writes replies for one client."""

    def __init__(self, server: ControlServer, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.server = server
        self._reader = reader
        self._writer = writer
        self._lock = asyncio.Lock()
        self._subscriber: _Subscriber | None = None

    async def send(self, message: Mapping[str, Any]) -> None:
        async with self._lock:
            self._writer.write(encode(message))
            await self._writer.drain()

    async def run(self) -> None:
        await self.send({"v": PROTOCOL_VERSION, "type": "hello", "protocol": PROTOCOL_VERSION,
                         "stage": self.server.stage_id, "server": f"skippyd {__version__}"})
        async for line in read_lines(self._reader):
            if line is None:
                await self.send(error_message(
                    "line_too_long", f"request lines are limited to {MAX_LINE_BYTES} bytes"))
            elif line.strip():
                await self._handle(line)

    async def _handle(self, line: bytes) -> None:
        try:
            request = parse_request(line)
        except ProtocolError as exc:
            await self.send(error_message(exc.code, exc.message, exc.req_id))
            return
        if request.op == "status":
            await self.send({**self.server.snapshot_message(), "id": request.req_id})
            return
        await self._unsubscribe()
        if request.op == "unsubscribe":
            await self.send({"v": PROTOCOL_VERSION, "id": request.req_id,
                             "type": "unsubscribed"})
            return
        await self.send({"v": PROTOCOL_VERSION, "id": request.req_id, "type": "subscribed"})
        self._subscriber = _Subscriber(self, request)

    async def _unsubscribe(self) -> None:
        subscriber, self._subscriber = self._subscriber, None
        if subscriber is not None:
            await subscriber.close()

    async def close(self, *, abort: bool) -> None:
        await self._unsubscribe()
        if abort:
            self._writer.transport.abort()
        else:
            self._writer.close()


# -- the server ------------------------------------------------------------------------------

class ControlServer:
    """The control socket of one stage.

    Args:
        path: Socket path (``control.socket``).
        stage_id: The stage's id, announced in ``hello``.
        snapshot: Builds the status snapshot (called on the event loop).
        telemetry: The worker's hub, for event subscriptions.
        group: Group given access to the socket (mode 0660); None keeps it owner-only.
        event_level: The events subscribers get (``telemetry.level``).
    """

    def __init__(self, path: Path, *, stage_id: str, snapshot: Callable[[], dict[str, Any]],
                 telemetry: TelemetryHub, group: str | None = None,
                 event_level: EventLevel = "summary") -> None:
        self.path = Path(path)
        self.stage_id = stage_id
        self.telemetry = telemetry
        self.event_level: EventLevel = event_level
        """The events subscribers get (``telemetry.level``): ``debug`` adds per-step ones."""
        self._snapshot = snapshot
        self._group = group
        self._server: asyncio.AbstractServer | None = None
        self._identity: tuple[int, int] | None = None
        self._connections: dict[asyncio.Task[Any], _Connection] = {}
        self._shared: tuple[float, dict[str, Any]] | None = None

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        """Bind the socket and accept clients.

        Raises:
            ControlSocketInUse: Another live process serves this path.
            ControlSocketError: The socket cannot be created.
        """
        sock = bind_control_socket(self.path, self.stage_id, self._group)
        st = os.stat(self.path)
        self._identity = (st.st_dev, st.st_ino)
        self._server = await asyncio.start_unix_server(self._serve_client, sock=sock)
        logger.info("control socket listening on %s", self.path)

    async def close(self) -> None:
        """Disconnect every client, stop listening and remove the socket file. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 2.0)
        self._remove_socket_file()

    def _remove_socket_file(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._identity:  # never remove a successor's socket
            self.path.unlink(missing_ok=True)

    def snapshot_message(self, *, shared: bool = False) -> dict[str, Any]:
        """A ``snapshot`` message; ``shared`` reuses one up to SNAPSHOT_REUSE_S old."""
        now = time.monotonic()
        if shared and self._shared is not None and now - self._shared[0] < SNAPSHOT_REUSE_S:
            return self._shared[1]
        try:
            snapshot = self._snapshot()
        except Exception as exc:  # a snapshot bug must not kill the connection
            logger.exception("building the status snapshot failed")
            return error_message("internal", f"snapshot failed: {exc!r}")
        message = {"v": PROTOCOL_VERSION, "type": "snapshot", "snapshot": snapshot}
        self._shared = (now, message)
        return message

    async def _serve_client(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= MAX_CONNECTIONS:
            writer.write(encode(error_message(
                "too_many_connections", f"at most {MAX_CONNECTIONS} clients at once")))
            writer.close()
            return
        conn = _Connection(self, reader, writer)
        self._connections[task] = conn
        aborted = False
        try:
            await conn.run()
        except asyncio.CancelledError:
            # NOTE: not re-raised: asyncio's stream callback calls task.exception() on
            # the handler task, which raises for a cancelled one (close() cancels us).
            aborted = True
        except (ConnectionError, OSError) as exc:
            logger.debug("control client gone: %s", exc)
        finally:
            del self._connections[task]
            await conn.close(abort=aborted)
