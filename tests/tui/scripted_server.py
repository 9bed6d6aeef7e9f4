"""A scripted control server for dashboard tests: a real asyncio Unix-socket server.

It speaks control protocol v1 (hello, status, subscribe, events, unsubscribe, errors),
sends ``snapshot`` (whatever the test last set) every ``interval_ms`` to subscribers,
and lets the test push events, ``dropped`` notices or raw lines, drop every client, or
stop and start again on the same path.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import fnmatch
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WAIT_S = 5.0


def make_snapshot(**overrides: Any) -> dict[str, Any]:
    """A complete snapshot of the protocol schema; ``overrides`` merge section by section."""
    latency = {"p50": None, "p95": None, "p99": None, "count": 0}
    snapshot: dict[str, Any] = {
        "stage": {"id": "stage-0", "index": 0, "model": "tiny", "layer_start": 0,
                  "layer_end": 4, "is_first": True, "is_final": True,
                  "offload": {"gpu_layers": 0, "main_gpu": 0, "tensor_split": [],
                              "gpu_backend": False}},
        "uptime_s": 1.0,
        "health": {"status": "ok", "reason": None},
        "lane_count": 2,
        "lanes": [],
        "queues": {"waiting": 0, "commands": 0, "direct": 0},
        "wave": {"active_sessions": 0, "batch_size": 2, "fullness": 0.0, "full": False},
        "kv": {"cells_used": 0, "cells_total": 512, "usage": 0.0},
        "prefix_cache": {"hits": 0, "misses": 0, "hit_rate": 0.0, "matched_tokens": 0,
                         "bytes_resident": 0, "bytes_host": 0, "evictions": 0},
        "throughput": {"prompt_tok_s": 0.0, "generation_tok_s": 0.0, "window_s": 10.0},
        "latency_ms": {name: dict(latency) for name in ("ttft", "itl", "e2e")},
        "counters": {"finished": 0, "failed": 0, "cancelled": 0, "rejected": 0,
                     "preempted": 0, "iterations": 0, "direct_iterations": 0, "prompt_tokens": 0,
                     "generation_tokens": 0},
        "scheduler": {"last_step_ms": 0.0, "last_overhead_ms": 0.0, "step_target_ms": 0.0,
                      "overhead_ratio": 0.0},
        "link": None,
    }
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(snapshot.get(key), dict):
            snapshot[key] = {**snapshot[key], **copy.deepcopy(dict(value))}
        else:
            snapshot[key] = copy.deepcopy(value)
    return snapshot


def make_link(**overrides: Any) -> dict[str, Any]:
    """A split stage's ``link`` section: a later stage's unless ``chain`` is given."""
    link: dict[str, Any] = {
        "stage_id": "stage-1", "stage_index": 1, "layer_start": 2, "layer_end": 4,
        "is_final": True, "chains": 1, "connections": 1, "batches": 0, "bytes_in": 0,
        "bytes_out": 0, "rejected": 0, "uptime_s": 10.0, "active_sessions": 0, "busy_s": 0.0,
        "links": [], "queued_batches": 0,
    }
    return {**link, **copy.deepcopy(overrides)}


@dataclass
class _Client:
    writer: asyncio.StreamWriter
    interval_s: float | None = None
    events: bool = False
    filter: list[str] = field(default_factory=list)
    ticker: asyncio.Task[None] | None = None


class ScriptedServer:
    """The server; use ``async with ScriptedServer(path) as server``.

    Args:
        path: Socket path to bind.
        stage: Stage id sent in the hello.
        hello: Whether to greet clients (False simulates a hung daemon).
    """

    def __init__(self, path: Path, *, stage: str = "stage-0", hello: bool = True) -> None:
        self.path = path
        self.stage = stage
        self.hello = hello
        self.snapshot: dict[str, Any] = make_snapshot()
        """Sent for ``status`` and on every subscriber tick; replace it freely."""
        self.requests: list[dict[str, Any]] = []
        """Every request received, in order."""
        self.num_connections = 0
        self._clients: list[_Client] = []
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> ScriptedServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Bind and listen; returns once the socket accepts connections."""
        self._server = await asyncio.start_unix_server(self._handle, path=str(self.path))

    async def stop(self) -> None:
        """Drop every client, stop listening and remove the socket file."""
        if self._server is not None:
            self._server.close()
            self._server = None
        await self.drop_clients()
        self.path.unlink(missing_ok=True)

    async def drop_clients(self) -> None:
        """Close every client connection (the server keeps listening)."""
        for client in list(self._clients):
            await self._close_client(client)
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    @property
    def subscribers(self) -> list[_Client]:
        """Clients subscribed to snapshots or events."""
        return [c for c in self._clients if c.interval_s is not None or c.events]

    async def wait_subscribers(self, count: int = 1, timeout_s: float = WAIT_S) -> None:
        """Wait until at least ``count`` clients are subscribed."""
        await wait_until(lambda: len(self.subscribers) >= count, timeout_s, "subscribers")

    async def send_event(self, name: str, attributes: Mapping[str, Any] | None = None,
                         ts: float | None = None, level: str = "summary") -> None:
        """Send a telemetry event to every client that asked for events and matches."""
        event = {"name": name, "ts": time.time() if ts is None else ts, "level": level,
                 "attributes": dict(attributes or {})}
        for client in self._clients:
            if client.events and (not client.filter or any(
                    fnmatch.fnmatchcase(name, pattern) for pattern in client.filter)):
                await self._send(client, {"type": "event", "event": event})

    async def send_to_all(self, message: Mapping[str, Any]) -> None:
        """Send ``message`` (``v`` added) to every connected client."""
        for client in list(self._clients):
            await self._send(client, dict(message))

    async def send_raw(self, line: bytes) -> None:
        """Write ``line`` as is to every connected client."""
        for client in list(self._clients):
            client.writer.write(line)
            with contextlib.suppress(OSError):
                await client.writer.drain()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        client = _Client(writer)
        self._clients.append(client)
        self.num_connections += 1
        try:
            if self.hello:
                await self._send(client, {"type": "hello", "protocol": 1, "stage": self.stage,
                                          "server": "skippyd scripted"})
            while line := await reader.readline():
                await self._answer(client, line)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._handlers.discard(task)
            await self._close_client(client)

    async def _answer(self, client: _Client, line: bytes) -> None:
        try:
            request = json.loads(line)
        except json.JSONDecodeError as exc:
            await self._error(client, None, "bad_json", str(exc))
            return
        self.requests.append(request)
        req_id, op = request.get("id"), request.get("op")
        if op == "status":
            await self._send(client, {"id": req_id, "type": "snapshot",
                                      "snapshot": self.snapshot})
        elif op in ("subscribe", "events"):
            await self._subscribe(client, request)
        elif op == "unsubscribe":
            self._unsubscribe(client)
            await self._send(client, {"id": req_id, "type": "unsubscribed"})
        else:
            await self._error(client, req_id, "unknown_op", f"unknown op {op!r}")

    async def _subscribe(self, client: _Client, request: Mapping[str, Any]) -> None:
        self._unsubscribe(client)
        client.events = bool(request.get("events", request["op"] == "events"))
        client.filter = list(request.get("filter") or [])
        await self._send(client, {"id": request.get("id"), "type": "subscribed"})
        if request["op"] == "subscribe":
            interval_ms = min(60_000, max(100, int(request.get("interval_ms", 1000))))
            client.interval_s = interval_ms / 1000
            client.ticker = asyncio.create_task(self._tick(client))

    def _unsubscribe(self, client: _Client) -> None:
        if client.ticker is not None:
            client.ticker.cancel()
        client.ticker, client.interval_s, client.events = None, None, False

    async def _tick(self, client: _Client) -> None:
        assert client.interval_s is not None
        while True:
            await self._send(client, {"type": "snapshot", "snapshot": self.snapshot})
            await asyncio.sleep(client.interval_s)

    async def _error(self, client: _Client, req_id: Any, code: str, message: str) -> None:
        await self._send(client, {"id": req_id, "type": "error",
                                  "error": {"code": code, "message": message}})

    async def _send(self, client: _Client, message: Mapping[str, Any]) -> None:
        client.writer.write(json.dumps({"v": 1, **message}).encode() + b"\n")
        with contextlib.suppress(OSError):
            await client.writer.drain()

    async def _close_client(self, client: _Client) -> None:
        if client not in self._clients:
            return
        self._clients.remove(client)
        self._unsubscribe(client)
        client.writer.close()
        with contextlib.suppress(OSError):
            await client.writer.wait_closed()


async def wait_until(predicate: Callable[[], bool], timeout_s: float = WAIT_S,
                     what: str = "condition") -> None:
    """Poll ``predicate`` every 10 ms until true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)
