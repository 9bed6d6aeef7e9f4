"""The control socket over real Unix sockets: files, protocol errors, subscriptions."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from skippyd.control.client import AsyncControlClient, ControlClient, ControlRequestError
from skippyd.control.protocol import MAX_LINE_BYTES
from skippyd.control.server import (
    SUBSCRIBER_BUFFER,
    ControlServer,
    ControlSocketError,
    ControlSocketInUse,
)
from skippyd.engine.telemetry_events import RequestPreempted, StepFinished, WorkerFailed
from skippyd.engine.worker.telemetry import TelemetryHub

WAIT_S = 10.0


class FakeSnapshot:
    """A snapshot callable that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False

    def __call__(self) -> dict[str, Any]:
        self.calls += 1
        if self.fail:
            raise RuntimeError("broken snapshot")
        return {"stage": {"id": "s0"}, "health": {"status": "ok", "reason": None},
                "calls": self.calls}


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short private directory (socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="skc"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def hub() -> TelemetryHub:
    return TelemetryHub()


@pytest.fixture
async def server(sock_dir: Path, hub: TelemetryHub) -> AsyncIterator[ControlServer]:
    control = ControlServer(sock_dir / "run" / "s0.sock", stage_id="s0", snapshot=FakeSnapshot(),
                            telemetry=hub)
    await control.start()
    yield control
    await control.close()


class RawClient:
    """Line-level access to the socket, for malformed input."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, path: Path) -> RawClient:
        reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
        client = cls(reader, writer)
        assert (await client.read())["type"] == "hello"
        return client

    async def send(self, data: bytes | dict[str, Any]) -> None:
        self.writer.write(data if isinstance(data, bytes) else json.dumps(data).encode() + b"\n")
        await self.writer.drain()

    async def read(self) -> dict[str, Any]:
        line = await asyncio.wait_for(self.reader.readline(), WAIT_S)
        assert line.endswith(b"\n"), "connection closed"
        return json.loads(line)

    async def close(self) -> None:
        self.writer.close()


# -- the socket file -------------------------------------------------------------------------

async def test_socket_is_owner_only_in_a_private_new_directory(server: ControlServer) -> None:
    st = os.stat(server.path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(server.path.parent).st_mode) == 0o700
    await server.close()
    assert not server.path.exists()


async def test_a_path_near_the_length_limit_still_gets_0600(sock_dir: Path,
                                                            hub: TelemetryHub) -> None:
    deep = sock_dir / ("d" * (98 - len(str(sock_dir)) - 1))
    path = deep / "a.sock"  # fits, but a private staging path next to it would not
    assert len(str(deep)) == 98 and len(os.fsencode(path)) <= 107
    control = ControlServer(path, stage_id="s0", snapshot=FakeSnapshot(), telemetry=hub)
    await control.start()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        async with await AsyncControlClient.connect(path) as client:
            assert client.stage == "s0"
    finally:
        await control.close()
    assert not path.exists()


async def test_group_socket_is_0660_and_owned_by_the_group(sock_dir: Path, hub: TelemetryHub
                                                           ) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    control = ControlServer(sock_dir / "s.sock", stage_id="s0", snapshot=FakeSnapshot(),
                            telemetry=hub, group=group)
    await control.start()
    try:
        st = os.stat(control.path)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == os.getgid()
    finally:
        await control.close()


async def test_unknown_group_is_refused(sock_dir: Path, hub: TelemetryHub) -> None:
    control = ControlServer(sock_dir / "s.sock", stage_id="s0", snapshot=FakeSnapshot(),
                            telemetry=hub, group="no-such-group-skippyd")
    with pytest.raises(ControlSocketError, match="no-such-group-skippyd"):
        await control.start()
    assert not control.path.exists()


async def test_stale_socket_is_replaced(sock_dir: Path, hub: TelemetryHub) -> None:
    path = sock_dir / "s.sock"
    crashed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    crashed.bind(str(path))
    crashed.close()  # the file stays, nobody listens: what a crash leaves behind
    assert path.is_socket()
    control = ControlServer(path, stage_id="s0", snapshot=FakeSnapshot(), telemetry=hub)
    await control.start()
    try:
        async with await AsyncControlClient.connect(path) as client:
            assert client.stage == "s0"
            assert (await client.status())["health"]["status"] == "ok"
    finally:
        await control.close()


async def test_live_socket_is_refused_and_left_alone(server: ControlServer,
                                                     hub: TelemetryHub) -> None:
    second = ControlServer(server.path, stage_id="s0", snapshot=FakeSnapshot(), telemetry=hub)
    with pytest.raises(ControlSocketInUse, match=f"another skippyd is serving stage s0 at "
                       f"{server.path}"):
        await second.start()
    await second.close()  # never started: nothing to remove, and it must not remove ours
    async with await AsyncControlClient.connect(server.path) as client:
        assert (await client.status())["stage"]["id"] == "s0"


async def test_non_socket_file_is_refused_untouched(sock_dir: Path, hub: TelemetryHub) -> None:
    path = sock_dir / "s.sock"
    path.write_text("precious")
    control = ControlServer(path, stage_id="s0", snapshot=FakeSnapshot(), telemetry=hub)
    with pytest.raises(ControlSocketError, match="not a socket"):
        await control.start()
    assert path.read_text() == "precious"


# -- requests and errors ---------------------------------------------------------------------

async def test_hello_then_status_echoes_the_id(server: ControlServer) -> None:
    reader, writer = await asyncio.open_unix_connection(str(server.path))
    client = RawClient(reader, writer)
    hello = await client.read()
    assert hello["v"] == 1 and hello["type"] == "hello" and hello["protocol"] == 1
    assert hello["stage"] == "s0" and hello["server"].startswith("skippyd ")
    await client.send({"v": 1, "id": "abc", "op": "status"})
    reply = await client.read()
    assert reply["id"] == "abc" and reply["type"] == "snapshot"
    assert reply["snapshot"]["stage"]["id"] == "s0"
    await client.close()


@pytest.mark.parametrize(("line", "code", "req_id"), [
    (b"{not json\n", "bad_json", None),
    (b"\xff\xfe\n", "bad_json", None),
    (b"[1, 2]\n", "bad_request", None),
    (b'{"v": 1, "id": 7}\n', "bad_request", 7),
    (b'{"v": 1, "id": 8, "op": "reboot"}\n', "unknown_op", 8),
    (b'{"v": 2, "id": 9, "op": "status"}\n', "unsupported_version", 9),
    (b'{"id": 10, "op": "status"}\n', "unsupported_version", 10),
    (b'{"v": true, "id": 11, "op": "status"}\n', "unsupported_version", 11),
    (b'{"v": 1, "id": 12, "op": "subscribe", "interval_ms": 5}\n', "bad_request", 12),
    (b'{"v": 1, "id": 13, "op": "subscribe", "events": "yes"}\n', "bad_request", 13),
    (b'{"v": 1, "id": 14, "op": "events", "filter": "stage.*"}\n', "bad_request", 14),
    (b'{"v": 1, "id": [1], "op": "status"}\n', "bad_request", None),
    (b"x" * (MAX_LINE_BYTES + 10) + b"\n", "line_too_long", None),
    (b"y" * (4 * MAX_LINE_BYTES) + b'{"v": 1}\n', "line_too_long", None),
])
async def test_bad_input_gets_an_error_line_and_the_connection_survives(
    server: ControlServer, line: bytes, code: str, req_id: Any
) -> None:
    client = await RawClient.open(server.path)
    await client.send(line)
    error = await client.read()
    assert error["type"] == "error" and error["v"] == 1
    assert error["error"]["code"] == code, error
    assert error["id"] == req_id
    assert error["error"]["message"]
    await client.send({"v": 1, "id": 99, "op": "status"})
    reply = await client.read()
    assert (reply["type"], reply["id"]) == ("snapshot", 99)
    await client.close()


async def test_a_line_just_under_the_limit_is_read(server: ControlServer) -> None:
    client = await RawClient.open(server.path)
    request = json.dumps({"v": 1, "id": 1, "op": "status", "pad": ""}).encode()
    padded = request.replace(b'"pad": ""', b'"pad": "' + b"p" * (MAX_LINE_BYTES - len(request))
                             + b'"')
    assert len(padded) == MAX_LINE_BYTES
    await client.send(padded + b"\n")
    assert (await client.read())["type"] == "snapshot"
    await client.close()


async def test_a_failing_snapshot_answers_internal_and_recovers(server: ControlServer) -> None:
    snapshot = server._snapshot
    assert isinstance(snapshot, FakeSnapshot)
    async with await AsyncControlClient.connect(server.path) as client:
        snapshot.fail = True
        with pytest.raises(ControlRequestError) as info:
            await client.status()
        assert info.value.code == "internal"
        snapshot.fail = False
        assert (await client.status())["health"]["status"] == "ok"


# -- subscriptions ---------------------------------------------------------------------------

async def test_twenty_subscribers_all_get_periodic_snapshots(server: ControlServer) -> None:
    clients = [await AsyncControlClient.connect(server.path) for _ in range(20)]

    async def two_snapshots(client: AsyncControlClient) -> list[dict[str, Any]]:
        seen = []
        async for message in await client.subscribe(interval_ms=100):
            assert message["type"] == "snapshot"
            seen.append(message["snapshot"])
            if len(seen) == 2:
                return seen
        raise AssertionError("subscription ended early")

    try:
        results = await asyncio.wait_for(asyncio.gather(*map(two_snapshots, clients)), WAIT_S)
    finally:
        for client in clients:
            await client.close()
    assert len(results) == 20
    assert all(len(r) == 2 and r[0]["stage"]["id"] == "s0" for r in results)


async def test_events_are_filtered_and_carry_their_attributes(server: ControlServer,
                                                              hub: TelemetryHub) -> None:
    async with await AsyncControlClient.connect(server.path) as client:
        messages = await client.events(filter=["request.*"])
        hub.publish(WorkerFailed("noise"))
        hub.publish(RequestPreempted("r-1", 3))
        message = await asyncio.wait_for(anext(messages), WAIT_S)
    assert message["type"] == "event" and message["v"] == 1
    event = message["event"]
    assert event["name"] == "request.preempted" and event["level"] == "summary"
    assert event["attributes"] == {"request_id": "r-1", "generated_tokens": 3}
    assert isinstance(event["ts"], float)


async def test_per_step_events_reach_subscribers_only_at_the_debug_level(
        sock_dir: Path, hub: TelemetryHub) -> None:
    step = StepFinished(7, 1, 0, 0, 0, 0, 0, 1, 0, 0, 2.0, 1.5, 0, 0, 0, 0)
    for level, expected in (("summary", ["worker.failed"]),
                            ("debug", ["worker.step", "worker.failed"])):
        control = ControlServer(sock_dir / f"{level}.sock", stage_id="s0",
                                snapshot=FakeSnapshot(), telemetry=hub, event_level=level)
        await control.start()
        try:
            async with await AsyncControlClient.connect(control.path) as client:
                messages = await client.events()
                hub.publish(step)
                hub.publish(WorkerFailed("then this"))
                names = [(await asyncio.wait_for(anext(messages), WAIT_S))["event"]["name"]
                         for _ in expected]
            assert names == expected
        finally:
            await control.close()


async def test_subscribe_with_events_mixes_snapshots_and_events(server: ControlServer,
                                                                hub: TelemetryHub) -> None:
    async with await AsyncControlClient.connect(server.path) as client:
        messages = await client.subscribe(interval_ms=60_000, events=True)
        first = await asyncio.wait_for(anext(messages), WAIT_S)
        assert first["type"] == "snapshot"  # one right away, then every interval_ms
        hub.publish(WorkerFailed("test"))
        second = await asyncio.wait_for(anext(messages), WAIT_S)
        assert second["type"] == "event" and second["event"]["name"] == "worker.failed"


async def test_unsubscribe_stops_the_stream(server: ControlServer, hub: TelemetryHub) -> None:
    client = await RawClient.open(server.path)
    await client.send({"v": 1, "id": 1, "op": "events"})
    assert (await client.read())["type"] == "subscribed"
    hub.publish(WorkerFailed("before"))
    assert (await client.read())["event"]["attributes"]["failure"] == "before"
    await client.send({"v": 1, "id": 2, "op": "unsubscribe"})
    assert await client.read() == {"v": 1, "id": 2, "type": "unsubscribed"}
    hub.publish(WorkerFailed("after"))
    await client.send({"v": 1, "id": 3, "op": "status"})
    reply = await client.read()
    assert (reply["type"], reply["id"]) == ("snapshot", 3)  # no event slipped in
    await client.close()


async def test_a_slow_subscriber_never_blocks_the_publisher(server: ControlServer,
                                                            hub: TelemetryHub) -> None:
    slow = await RawClient.open(server.path)
    await slow.send({"v": 1, "id": 1, "op": "events"})
    assert (await slow.read())["type"] == "subscribed"
    num_events = 20 * SUBSCRIBER_BUFFER
    padding = "p" * 200  # fills the socket buffer well before the end
    published = threading.Event()

    def worker() -> None:  # publishes like the worker thread, while the client never reads
        for index in range(num_events):
            hub.publish(RequestPreempted(padding, index))
        published.set()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    assert await asyncio.to_thread(published.wait, WAIT_S), "the publisher blocked"
    received, dropped, last = 0, 0, -1
    while last != num_events - 1:
        message = await slow.read()
        if message["type"] == "dropped":
            dropped += message["count"]
        else:
            assert message["type"] == "event"
            assert message["event"]["attributes"]["generated_tokens"] > last  # in order
            last = message["event"]["attributes"]["generated_tokens"]
            received += 1
    assert dropped > 0
    assert received + dropped == num_events
    await slow.close()


async def test_close_ends_subscriptions_and_removes_the_socket(server: ControlServer) -> None:
    client = await AsyncControlClient.connect(server.path)
    messages = await client.subscribe(interval_ms=100)
    assert (await asyncio.wait_for(anext(messages), WAIT_S))["type"] == "snapshot"
    await asyncio.wait_for(server.close(), WAIT_S)
    rest = await asyncio.wait_for(_collect(messages), WAIT_S)
    assert all(m["type"] == "snapshot" for m in rest)
    assert not server.path.exists()
    assert server.num_connections == 0
    await client.close()


async def _collect(messages: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    return [message async for message in messages]


async def test_blocking_client_status_and_subscribe(server: ControlServer) -> None:
    def use_blocking_client() -> tuple[dict[str, Any], list[str]]:
        with ControlClient.connect(server.path) as client:
            assert client.stage == "s0"
            snapshot = client.status()
            types = []
            for message in client.subscribe(interval_ms=100):
                types.append(message["type"])
                if len(types) == 2:
                    break
            assert client.status()["health"]["status"] == "ok"  # works while subscribed
            with pytest.raises(ControlRequestError, match="interval_ms"):
                client.request("subscribe", interval_ms=1)
            return snapshot, types

    snapshot, types = await asyncio.wait_for(asyncio.to_thread(use_blocking_client), WAIT_S)
    assert snapshot["stage"]["id"] == "s0"
    assert types == ["snapshot", "snapshot"]


async def test_a_client_vanishing_mid_stream_is_cleaned_up(server: ControlServer, hub: TelemetryHub,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    client = await RawClient.open(server.path)
    await client.send({"v": 1, "id": 1, "op": "subscribe", "interval_ms": 100, "events": True})
    assert (await client.read())["type"] == "subscribed"
    client.writer.transport.abort()
    for index in range(2000):
        hub.publish(RequestPreempted("after-close", index))

    async def gone() -> None:
        while server.num_connections:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(gone(), WAIT_S)
    async with await AsyncControlClient.connect(server.path) as other:
        assert (await other.status())["health"]["status"] == "ok"
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
