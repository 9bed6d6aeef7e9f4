"""The dashboard's control-socket feed, and finding the socket."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from scripted_server import ScriptedServer, make_snapshot

from skippyd.control.client import resolve_socket_path
from skippyd.tui.source import (
    Backoff,
    Connected,
    ControlFeed,
    Disconnected,
    Dropped,
    EventReceived,
    FeedItem,
    ServerError,
    SnapshotReceived,
    to_item,
)

WAIT_S = 5.0


async def next_of(items: AsyncIterator[FeedItem], kind: type) -> FeedItem:
    """The next item of type ``kind`` (others skipped), within WAIT_S."""
    async with asyncio.timeout(WAIT_S):
        async for item in items:
            if isinstance(item, kind):
                return item
    raise AssertionError("feed ended")


def fast_feed(path: Path, **kwargs) -> ControlFeed:
    return ControlFeed(path, interval_ms=100, backoff=Backoff(0.02, 0.1), **kwargs)


def test_backoff_doubles_to_cap_and_resets() -> None:
    backoff = Backoff(0.5, 5.0)
    assert [backoff.next_delay() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    backoff.reset()
    assert backoff.next_delay() == 0.5
    with pytest.raises(ValueError, match="bad backoff"):
        Backoff(2.0, 1.0)


def test_to_item_types() -> None:
    assert to_item({"v": 1, "type": "dropped", "count": 3}) == Dropped(3)
    assert to_item({"v": 1, "type": "subscribed", "id": 1}) is None
    assert to_item({"v": 1, "type": "something_new"}) is None
    error = to_item({"v": 1, "id": None, "type": "error",
                     "error": {"code": "bad_request", "message": "no"}})
    assert error == ServerError("bad_request", "no")
    event = to_item({"v": 1, "type": "event",
                     "event": {"name": "stage.x", "ts": 2.5, "attributes": {"a": 1}}})
    assert event == EventReceived("stage.x", 2.5, {"a": 1})
    odd = to_item({"v": 1, "type": "event", "event": {"name": "stage.y", "ts": None,
                                                     "attributes": []}})
    assert odd == EventReceived("stage.y", 0.0, {})
    snapshot = to_item({"v": 1, "type": "snapshot", "snapshot": {"uptime_s": 1.0}})
    assert snapshot == SnapshotReceived({"uptime_s": 1.0})


async def test_feed_subscribes_and_yields_items(server: ScriptedServer) -> None:
    server.snapshot = make_snapshot(queues={"waiting": 7})
    items = fast_feed(server.path).follow()
    hello = await next_of(items, Connected)
    assert hello == Connected("stage-0", "skippyd scripted")
    snapshot = await next_of(items, SnapshotReceived)
    assert snapshot.snapshot["queues"]["waiting"] == 7
    assert server.requests[0] == {"v": 1, "id": 1, "op": "subscribe", "interval_ms": 100,
                                  "events": True}
    await server.send_event("worker.step", {"batch": 4}, ts=9.0, level="debug")
    event = await next_of(items, EventReceived)
    assert event == EventReceived("worker.step", 9.0, {"batch": 4}, "debug")
    await server.send_to_all({"type": "dropped", "count": 12})
    assert await next_of(items, Dropped) == Dropped(12)
    await items.aclose()


async def test_feed_reconnects_after_the_daemon_goes_away(server: ScriptedServer) -> None:
    feed = fast_feed(server.path)
    items = feed.follow()
    await next_of(items, SnapshotReceived)
    await server.stop()
    gone = await next_of(items, Disconnected)
    assert gone.retry_in_s == pytest.approx(0.02)
    failed = await next_of(items, Disconnected)
    assert "cannot connect" in failed.reason
    assert failed.retry_in_s == pytest.approx(0.04)
    server.snapshot = make_snapshot(queues={"waiting": 2})
    await server.start()
    await next_of(items, Connected)
    snapshot = await next_of(items, SnapshotReceived)
    assert snapshot.snapshot["queues"]["waiting"] == 2
    assert feed.backoff.next_delay() == pytest.approx(0.02)  # reset by the new hello
    assert server.num_connections == 2
    await items.aclose()


async def test_feed_backoff_without_a_daemon(socket_path: Path) -> None:
    delays: list[float] = []

    async def record_sleep(delay: float) -> None:
        delays.append(delay)

    items = ControlFeed(socket_path, sleep=record_sleep).follow()
    reasons = [await next_of(items, Disconnected) for _ in range(6)]
    await items.aclose()
    assert delays[:5] == [0.5, 1.0, 2.0, 4.0, 5.0]
    assert [r.retry_in_s for r in reasons] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert all(str(socket_path) in r.reason for r in reasons)


async def test_feed_drops_a_silent_daemon(socket_path: Path) -> None:
    async with ScriptedServer(socket_path) as server:
        server.snapshot = make_snapshot()
        feed = ControlFeed(socket_path, interval_ms=60_000, backoff=Backoff(0.02, 0.1),
                           silence_timeout_s=0.3)
        items = feed.follow()
        await next_of(items, SnapshotReceived)  # the first tick is immediate
        gone = await next_of(items, Disconnected)
        assert "silent" in gone.reason
        await items.aclose()


async def test_feed_treats_a_missing_hello_as_a_failure(socket_path: Path) -> None:
    async with ScriptedServer(socket_path, hello=False):
        items = ControlFeed(socket_path, timeout_s=0.2, backoff=Backoff(0.02, 0.1)).follow()
        gone = await next_of(items, Disconnected)
        assert "no hello" in gone.reason
        await items.aclose()


async def test_feed_reconnects_after_a_garbage_line(server: ScriptedServer) -> None:
    items = fast_feed(server.path).follow()
    await next_of(items, SnapshotReceived)
    await server.send_raw(b"{oops\n")
    await next_of(items, Disconnected)
    await next_of(items, Connected)
    assert server.num_connections == 2
    await items.aclose()


def test_resolve_socket_path_prefers_the_flag(tmp_path: Path) -> None:
    flag = tmp_path / "flag.sock"
    config = tmp_path / "missing.toml"  # never read when --socket is given
    assert resolve_socket_path(flag, config) == flag


def test_resolve_socket_path_from_config(tmp_path: Path) -> None:
    config = tmp_path / "stage.toml"
    config.write_text('[stage]\nid = "edge"\n[control]\nsocket = "run/edge.sock"\n')
    assert resolve_socket_path(None, config) == tmp_path / "run" / "edge.sock"


def bind_socket(path: Path) -> socket.socket:
    """A bound (not listening) Unix socket file at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    return sock


def test_resolve_socket_path_probes_default_locations(
        socket_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = socket_path.parent
    xdg, systemd = base / "xdg", base / "sd"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(systemd))
    monkeypatch.setattr(tempfile, "tempdir", str(base / "tmp"))
    config = base / "stage.toml"
    config.write_text('[stage]\nid = "edge"\n')
    assert resolve_socket_path(None, config) == xdg / "skippyd" / "edge.sock"
    # the dashboard waits at the preferred location for a daemon not there yet
    assert resolve_socket_path(None, None, wait=True) == xdg / "skippyd" / "stage-0.sock"
    with contextlib.closing(bind_socket(systemd / "edge.sock")):
        # the daemon ran with systemd's environment
        assert resolve_socket_path(None, config) == systemd / "edge.sock"
        # without a config, the only socket around is found, whatever its stage
        assert resolve_socket_path(None, None) == systemd / "edge.sock"
        with contextlib.closing(bind_socket(xdg / "skippyd" / "stage-0.sock")):
            assert resolve_socket_path(None, None) == xdg / "skippyd" / "stage-0.sock"
