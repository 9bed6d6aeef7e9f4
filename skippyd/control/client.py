"""Clients of a stage's control socket (protocol v1, ``docs/control-protocol.md``).

:class:`ControlClient` is blocking (``skippyd status``, scripts); :class:`AsyncControlClient`
suits an asyncio program such as the ``skippyd top`` dashboard. Both connect by socket
path, read the server's ``hello``, answer :meth:`status` with the snapshot dict, and after
:meth:`subscribe` / :meth:`events` yield the pushed messages (``snapshot``, ``event`` and
``dropped`` dicts, exactly as sent). :func:`resolve_socket_path` finds the socket for
``skippyd status`` and ``skippyd top`` alike.

Example::

    with ControlClient.connect(path) as client:
        print(client.status()["health"])
        for message in client.subscribe(interval_ms=500, events=True):
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
from collections import deque
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from skippyd.control.protocol import DEFAULT_INTERVAL_MS, PROTOCOL_VERSION, encode

logger = logging.getLogger(__name__)

#: Longest line a client accepts from the server (snapshots are far smaller).
MAX_REPLY_BYTES = 16 * 1024 * 1024
#: Pushed messages a client buffers while waiting for a reply, before dropping the oldest.
MAX_PENDING_MESSAGES = 4096
_REPLY_TYPES = frozenset({"snapshot", "subscribed", "unsubscribed", "error"})


class ControlError(Exception):
    """Base of the control client's errors."""


class ControlConnectError(ControlError):
    """The control socket cannot be found, reached or read."""


class ControlClosed(ControlConnectError):
    """The server closed the connection."""


class ControlRequestError(ControlError):
    """The server answered a request with an ``error`` line.

    Attributes:
        code: The protocol error code (``bad_request``, ``unknown_op``...).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def _instance_sockets() -> set[Path]:
    """Sockets in the runtime directories of the template unit's instances."""
    from skippyd.config import defaults

    try:
        return {p for p in defaults.SYSTEM_RUNTIME_DIR.glob("*/*.sock") if p.is_socket()}
    except OSError:
        return set()


def resolve_socket_path(socket_path: Path | None = None, config: Path | None = None, *,
                        wait: bool = False) -> Path:
    """Find a stage's control socket; ``skippyd status``, ``top`` and ``top --once`` agree.

    ``socket_path``, else the config's ``control.socket``, else the default stage's
    default locations, else the only socket in the default directories;
    ``docs/control-protocol.md``, *The socket*, has the details.

    Args:
        socket_path: ``--socket``, if given.
        config: ``--config``, if given.
        wait: For a client that waits for the daemon (the dashboard): when no socket
            exists yet, return the preferred default location instead of failing.

    Raises:
        ConfigError: ``config`` does not load.
        ControlConnectError: Several sockets exist and none is preferred, or (without
            ``wait``) none exists.
    """
    from skippyd.config import candidate_socket_paths, default_socket_path, load_config
    from skippyd.config.schema import DEFAULT_STAGE_ID

    if socket_path is not None:
        return Path(socket_path)
    stage_id = DEFAULT_STAGE_ID
    if config is not None:
        loaded = load_config(config)
        configured, stage_id = loaded.control.socket_path, loaded.stage.id
        if configured.is_socket() or configured != default_socket_path(stage_id):
            return configured
    candidates = candidate_socket_paths(stage_id)
    existing = next((path for path in candidates if path.is_socket()), None)
    if existing is not None:
        return existing
    if config is not None:
        return candidates[0]  # connecting names the missing socket
    found = sorted({p for c in candidates if c.parent.is_dir()
                    for p in c.parent.glob("*.sock") if p.is_socket()}
                   | _instance_sockets())
    if len(found) == 1:
        return found[0]
    if found:
        raise ControlConnectError("several control sockets found; pick one with --socket: "
                                  + ", ".join(map(str, found)))
    if wait:
        return candidates[0]
    raise ControlConnectError("no control socket found (is skippyd running?); looked in "
                              + ", ".join(str(c.parent) for c in candidates))


def _decode(line: bytes) -> dict[str, Any]:
    if not line.endswith(b"\n"):
        raise ControlClosed("the control socket closed the connection")
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise ControlConnectError(f"the server sent a line that is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ControlConnectError("the server sent a line that is not a JSON object")
    return message


def _check_hello(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("type") != "hello" or message.get("protocol") != PROTOCOL_VERSION:
        raise ControlConnectError(f"not a skippyd v{PROTOCOL_VERSION} control socket "
                                  f"(first line: {str(message)[:200]})")
    return message


def _result(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("type") == "error":
        error = message.get("error") or {}
        raise ControlRequestError(str(error.get("code")), str(error.get("message")))
    return message


def _subscribe_fields(interval_ms: int, events: bool,
                      filter: list[str] | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"interval_ms": interval_ms, "events": events}
    if filter:
        fields["filter"] = list(filter)
    return fields


class ControlClient:
    """A blocking control-socket connection. Use :meth:`connect`.

    Not thread-safe: use one client per thread.
    """

    def __init__(self, sock: socket.socket, path: Path) -> None:
        self.path = path
        self._sock = sock
        self._file = sock.makefile("rb")
        self._ids = itertools.count(1)
        self._pushed: deque[dict[str, Any]] = deque(maxlen=MAX_PENDING_MESSAGES)
        self.hello = _check_hello(self._read())

    @classmethod
    def connect(cls, path: Path | str, timeout_s: float | None = 10.0) -> ControlClient:
        """Connect to the socket at ``path`` and read its ``hello``.

        Args:
            path: The control socket.
            timeout_s: Limit of every blocking read (None waits forever).

        Raises:
            ControlConnectError: Nothing (or not a skippyd) listens there.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
            return cls(sock, Path(path))
        except OSError as exc:
            sock.close()
            raise ControlConnectError(f"cannot connect to {path}: {exc}") from exc
        except BaseException:
            sock.close()
            raise

    @property
    def stage(self) -> str:
        return str(self.hello.get("stage", ""))

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and return its reply (pushed messages read meanwhile are kept).

        Raises:
            ControlRequestError: The server answered with an error.
            ControlConnectError: The connection failed or timed out.
        """
        req_id = next(self._ids)
        try:
            self._sock.sendall(encode({"v": PROTOCOL_VERSION, "id": req_id, "op": op, **fields}))
        except OSError as exc:
            raise ControlConnectError(f"cannot send to {self.path}: {exc}") from exc
        while True:
            message = self._read()
            if message.get("type") in _REPLY_TYPES and message.get("id", None) == req_id:
                return _result(message)
            if message.get("type") == "error" and message.get("id") is None:
                return _result(message)  # the server could not read our request's id
            self._pushed.append(message)

    def status(self) -> dict[str, Any]:
        """The stage's current snapshot."""
        return self.request("status")["snapshot"]

    def subscribe(self, interval_ms: int = DEFAULT_INTERVAL_MS, events: bool = False,
                  filter: list[str] | None = None) -> Iterator[dict[str, Any]]:
        """Subscribe, then iterate over the pushed messages until the server closes."""
        self.request("subscribe", **_subscribe_fields(interval_ms, events, filter))
        return self.messages()

    def events(self, filter: list[str] | None = None) -> Iterator[dict[str, Any]]:
        """Subscribe to telemetry events only (no periodic snapshots)."""
        self.request("events", **({"filter": list(filter)} if filter else {}))
        return self.messages()

    def unsubscribe(self) -> None:
        self.request("unsubscribe")

    def messages(self) -> Iterator[dict[str, Any]]:
        """Pushed messages, oldest first; ends when the server closes the connection.

        Raises:
            ControlConnectError: A read failed or timed out (see ``timeout_s``).
        """
        while True:
            while self._pushed:
                yield self._pushed.popleft()
            try:
                yield self._read()
            except ControlClosed:
                return

    def _read(self) -> dict[str, Any]:
        try:
            line = self._file.readline(MAX_REPLY_BYTES)
        except OSError as exc:  # timeouts included
            raise ControlConnectError(f"reading from {self.path} failed: {exc!r}") from exc
        return _decode(line)

    def close(self) -> None:
        """Close the connection. Idempotent."""
        self._file.close()
        self._sock.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncControlClient:
    """An asyncio control-socket connection. Use :meth:`connect`.

    A reader task routes replies to the waiting request and queues pushed messages (at
    most :data:`MAX_PENDING_MESSAGES`, oldest dropped) for :meth:`messages`.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 hello: dict[str, Any], path: Path) -> None:
        self.path = path
        self.hello = hello
        self._writer = writer
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._pushed: deque[dict[str, Any] | None] = deque(maxlen=MAX_PENDING_MESSAGES)
        self._arrived = asyncio.Event()
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(reader))

    @classmethod
    async def connect(cls, path: Path | str, timeout_s: float = 10.0) -> AsyncControlClient:
        """Connect to the socket at ``path`` and read its ``hello``.

        Raises:
            ControlConnectError: Nothing (or not a skippyd) listens there.
        """
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(path), limit=MAX_REPLY_BYTES), timeout_s)
        except (OSError, TimeoutError) as exc:
            raise ControlConnectError(f"cannot connect to {path}: {exc!r}") from exc
        try:
            hello = _check_hello(_decode(await asyncio.wait_for(reader.readline(), timeout_s)))
        except BaseException as exc:
            writer.close()
            if isinstance(exc, OSError | TimeoutError | ValueError):
                raise ControlConnectError(f"no hello from {path}: {exc!r}") from exc
            raise
        return cls(reader, writer, hello, Path(path))

    @property
    def stage(self) -> str:
        return str(self.hello.get("stage", ""))

    async def request(self, op: str, timeout_s: float = 10.0, **fields: Any) -> dict[str, Any]:
        """Send one request and await its reply.

        Raises:
            ControlRequestError: The server answered with an error.
            ControlConnectError: The connection failed or the reply timed out.
        """
        req_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[req_id] = future
        try:
            self._writer.write(encode({"v": PROTOCOL_VERSION, "id": req_id, "op": op,
                                       **fields}))
            await self._writer.drain()
            return _result(await asyncio.wait_for(future, timeout_s))
        except (OSError, TimeoutError) as exc:
            raise ControlConnectError(f"{op} on {self.path} failed: {exc!r}") from exc
        finally:
            self._waiting.pop(req_id, None)

    async def status(self) -> dict[str, Any]:
        """The stage's current snapshot."""
        return (await self.request("status"))["snapshot"]

    async def subscribe(self, interval_ms: int = DEFAULT_INTERVAL_MS, events: bool = False,
                        filter: list[str] | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """Subscribe; returns :meth:`messages` (``async for m in await c.subscribe()``)."""
        await self.request("subscribe", **_subscribe_fields(interval_ms, events, filter))
        return self.messages()

    async def events(self, filter: list[str] | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """Subscribe to telemetry events only (no periodic snapshots)."""
        fields: dict[str, Any] = {"filter": list(filter)} if filter else {}
        await self.request("events", **fields)
        return self.messages()

    async def unsubscribe(self) -> None:
        await self.request("unsubscribe")

    async def messages(self) -> AsyncGenerator[dict[str, Any], None]:
        """Pushed messages, oldest first; ends when the connection closes."""
        while True:
            while self._pushed:
                message = self._pushed.popleft()
                if message is None:
                    self._pushed.append(None)  # keep the end mark for later iterators
                    return
                yield message
            self._arrived.clear()
            await self._arrived.wait()

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = _decode(await reader.readline())
                future = self._waiting.get(message.get("id"))  # type: ignore[arg-type]
                is_reply = message.get("type") in _REPLY_TYPES
                if is_reply and future is not None and not future.done():
                    future.set_result(message)
                elif message.get("type") == "error" and message.get("id") is None:
                    for waiting in self._waiting.values():
                        if not waiting.done():
                            waiting.set_result(message)
                else:
                    self._pushed.append(message)
                    self._arrived.set()
        except (ControlConnectError, OSError, ValueError) as exc:
            logger.debug("control connection to %s ended: %r", self.path, exc)
        finally:
            gone = ControlConnectError(f"the connection to {self.path} closed")
            for waiting in self._waiting.values():
                if not waiting.done():
                    waiting.set_exception(gone)
            self._pushed.append(None)
            self._arrived.set()

    async def close(self) -> None:
        """Close the connection. Idempotent."""
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader_task
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    async def __aenter__(self) -> AsyncControlClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
