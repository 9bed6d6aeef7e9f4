"""The connection guard on a real uvicorn server, with h11 and with httptools.

Each test plays a hostile or careless client on raw sockets and waits (bounded) for
the server to close the connection; the guard's counters say which deadline fired.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from http_support import wait_until

from skippyd.http.api.routes import create_app
from skippyd.http.guard.connections import (
    ConnectionGuard,
    ConnectionLimits,
    fit_fd_limit,
    guarded_protocol,
    protocol_class,
)
from skippyd.http.parsing.request_params import HttpLimits

WAIT_S = 10.0
SHORT_S = 0.5
HEAD = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"
PROTOCOLS = ["h11", pytest.param("httptools", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("httptools"), reason="httptools not installed"))]


@pytest.fixture(params=PROTOCOLS)
def protocol(request: pytest.FixtureRequest) -> str:
    return request.param


@contextlib.asynccontextmanager
async def guarded(fake: Any, protocol: str, **limits: Any) -> AsyncIterator[tuple[Any, ConnectionGuard]]:
    """Serve the app behind a guard with short deadlines; yields ((host, port), guard)."""
    settings = {"header_timeout_s": SHORT_S, "body_timeout_s": SHORT_S,
                "keep_alive_timeout_s": SHORT_S, "send_timeout_s": SHORT_S, **limits}
    guard = ConnectionGuard(ConnectionLimits(**settings))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    app = create_app(fake, limits=HttpLimits(), max_concurrent_requests=4)
    config = uvicorn.Config(app, log_level="warning", lifespan="off",
                            http=guarded_protocol(protocol_class(protocol), guard),
                            timeout_keep_alive=settings["keep_alive_timeout_s"] + 5)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield sock.getsockname(), guard
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT_S)
        sock.close()


def _connect(address: Any, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(address)
    return sock


def _read_until_closed(sock: socket.socket, timeout: float = WAIT_S) -> bytes:
    """Everything the server sends until it closes the connection (fails on timeout)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _drip(sock: socket.socket, data: bytes, every_s: float) -> int:
    """Send ``data`` one byte at a time until the server closes; returns bytes sent."""
    for sent, byte in enumerate(data):
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return sent
        readable, _, _ = select.select([sock], [], [], every_s)
        if readable:  # the server answered or closed: the drip is over
            return sent + 1
    return len(data)


async def test_silent_connection_is_closed_at_the_header_deadline(fake, protocol):
    async with guarded(fake, protocol) as (address, guard):
        with _connect(address) as sock:
            assert await asyncio.to_thread(_read_until_closed, sock) == b""
        assert guard.counters["header_timeouts"] == 1
        assert guard.open == set()


async def test_dripped_head_is_cut_at_an_absolute_deadline(fake, protocol):
    head = b"GET /health HTTP/1.1\r\n" + b"".join(b"X-Pad-%d: x\r\n" % i for i in range(40))
    async with guarded(fake, protocol) as (address, guard):
        with _connect(address) as sock:
            sent = await asyncio.to_thread(_drip, sock, head, 0.05)
            answer = await asyncio.to_thread(_read_until_closed, sock)
        assert sent < len(head)  # every byte came well within any per-read timeout
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert guard.counters["header_timeouts"] == 1


async def test_dripped_body_is_cut_and_the_handler_ends_quietly(fake, protocol, caplog):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 400\r\n\r\n")
    async with guarded(fake, protocol) as (address, guard):
        with _connect(address) as sock:
            sock.sendall(head)
            await asyncio.to_thread(_drip, sock, b'{"prompt": "' + b"x" * 380, 0.05)
            await asyncio.to_thread(_read_until_closed, sock)
        assert guard.counters["body_timeouts"] == 1
        # A request arriving afterwards is served: the dripping one held nothing.
        async with httpx.AsyncClient(timeout=WAIT_S) as client:
            response = await client.get(f"http://{address[0]}:{address[1]}/health")
        assert response.status_code == 200
    assert fake.generations == {}
    assert "Traceback" not in caplog.text and "Exception in ASGI" not in caplog.text


async def test_idle_keep_alive_connection_is_closed(fake, protocol):
    async with guarded(fake, protocol) as (address, guard):
        with _connect(address) as sock:
            sock.sendall(HEAD)
            answer = await asyncio.to_thread(_read_until_closed, sock)
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert guard.counters["header_timeouts"] == 1  # the keep-alive wait for the next


async def test_idle_connections_give_way_to_new_clients(fake, protocol):
    async with guarded(fake, protocol, header_timeout_s=60.0, max_open_connections=8) as (
            address, guard):
        idle = [_connect(address) for _ in range(8)]
        url = f"http://{address[0]}:{address[1]}"
        try:
            async with httpx.AsyncClient(timeout=WAIT_S) as client:
                for _ in range(3):
                    assert (await client.get(f"{url}/health")).status_code == 200
                    completion = await client.post(f"{url}/v1/completions",
                                                   json={"prompt": "x", "max_tokens": 2})
                    assert completion.status_code == 200
            # The oldest idle connection gave way first.
            assert await asyncio.to_thread(_read_until_closed, idle[0]) == b""
            assert guard.counters["evicted"] >= 1
            assert len(guard.open) <= 8
        finally:
            for sock in idle:
                sock.close()


async def test_a_client_that_stops_reading_is_dropped(protocol, fake):
    fake = type(fake)("y" * 20_000, ctx_size=40_000)
    body = (b'{"prompt": "x", "stream": true, "max_tokens": 30000}')
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    try:
        async with guarded(fake, protocol, header_timeout_s=60.0) as (address, guard):
            with _connect(address, rcvbuf=4096) as sock:
                sock.sendall(head + body)
                generation = await asyncio.to_thread(_wait_for_generation, fake)
                # Never read: the server's buffers fill, then the send deadline fires. The
                # generation does not wait for the socket (its tokens queue in the stream,
                # bounded by max_tokens), so it may well have finished by then.
                await wait_until(lambda: guard.counters["send_timeouts"] == 1)
                assert await asyncio.to_thread(generation.done.wait, WAIT_S)
            assert guard.open == set()
        assert generation.outcome in ("cancelled", "stopped", "eog")
    finally:
        for generation in fake.generations.values():
            generation.cancelled.set()
        fake.join()


def _wait_for_generation(fake: Any) -> Any:
    for _ in range(int(WAIT_S / 0.01)):
        if fake.generations:
            return fake.only_generation()
        select.select([], [], [], 0.01)
    raise TimeoutError("no generation started")


async def test_an_oversized_head_is_refused(fake, protocol):
    async with guarded(fake, protocol, max_head_bytes=1024) as (address, guard):
        with _connect(address) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nX-Big: " + b"y" * 2048)
            answer = await asyncio.to_thread(_read_until_closed, sock)
        assert answer.startswith(b"HTTP/1.1 431 ")
        assert guard.counters["heads_too_large"] == 1


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="header_timeout_s"):
        ConnectionLimits(header_timeout_s=0)
    with pytest.raises(ValueError, match="max_open_connections"):
        ConnectionLimits(max_open_connections=0)


def test_the_cap_is_fitted_to_the_open_files_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
        assert fit_fd_limit(1000) == 1000  # the soft limit is raised to make room
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 1000 + 256
        if hard != resource.RLIM_INFINITY:
            assert fit_fd_limit(hard) == hard - 256  # beyond the hard limit: clamped
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_large_body_sent_with_its_head_is_not_a_large_head(fake, protocol):
    body = b'{"prompt": "x", "user": "' + b"u" * 200_000 + b'", "max_tokens": 2}'
    async with guarded(fake, protocol, max_head_bytes=1024) as (address, guard):
        async with httpx.AsyncClient(timeout=WAIT_S) as client:
            response = await client.post(f"http://{address[0]}:{address[1]}/v1/completions",
                                         content=body)
    assert response.status_code == 200, response.text
    assert guard.counters["heads_too_large"] == 0
