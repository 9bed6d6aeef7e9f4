"""The link shaper forwards bytes intact, adds its delay and bandwidth cap, passes the
end of a stream on, and closes its connections."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from skippyd.bench.shaper import LinkShape, LinkShaper, main


@pytest.fixture
def echo_server():
    """A loopback echo server; yields its address."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[:2]
    stop.set()
    server.close()


def _round_trip(address, payload: bytes) -> tuple[bytes, float]:
    with socket.create_connection(address, timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
        return b"".join(chunks), time.monotonic() - started


def test_bytes_arrive_intact_after_the_round_trip_time(echo_server):
    payload = os.urandom(300_000)
    with LinkShaper(echo_server, LinkShape(rtt_s=0.04)) as shaper:
        echoed, elapsed = _round_trip(shaper.address, payload)
    assert echoed == payload
    assert elapsed >= 0.04  # one way there, one way back


def test_the_bandwidth_cap_paces_a_transfer(echo_server):
    payload = os.urandom(250_000)  # 2 Mbit each way at 8 Mbit/s: at least 0.25 s
    with LinkShaper(echo_server, LinkShape(rate_bits_per_s=8e6)) as shaper:
        echoed, elapsed = _round_trip(shaper.address, payload)
    assert echoed == payload and elapsed >= 0.25


def test_an_unreachable_target_closes_the_client(echo_server):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[:2]
    with LinkShaper(dead, LinkShape()) as shaper:
        with socket.create_connection(shaper.address, timeout=10) as sock:
            assert sock.recv(1) == b""


def test_close_cuts_open_connections(echo_server):
    shaper = LinkShaper(echo_server, LinkShape()).start()
    sock = socket.create_connection(shaper.address, timeout=10)
    sock.sendall(b"ping")
    assert sock.recv(4) == b"ping"
    shaper.close()
    assert sock.recv(1) == b""
    sock.close()


@pytest.mark.parametrize("argv", [["--target", "nowhere"],
                                  ["--target", "127.0.0.1:1", "--rtt-ms", "-1"],
                                  ["--target", "127.0.0.1:1", "--rate-mbit", "0"]])
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
