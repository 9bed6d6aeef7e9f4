"""The silence watch on real loopback connections: a silent peer is reported within the
timeout, a pinging or merely unread one never is, and one connection whose peer reads
nothing holds back no other connection's PINGs."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from skippyd.config import ConfigError, parse_config
from skippyd.link.framing import FrameSocket
from skippyd.link.liveness import CHECK_INTERVAL_S, SILENCE_TIMEOUT_S, SilenceWatch
from skippyd.link.probe import LinkPinger
from skippyd.link.wire import LinkLimits, encode_ping

TIMEOUT_S = 0.5
WAIT_S = 10.0


@pytest.fixture
def pairs() -> Iterator[list[tuple[FrameSocket, socket.socket]]]:
    """A factory's list of connected (watched end, peer end) TCP pairs, closed after."""
    made: list[tuple[FrameSocket, socket.socket]] = []
    yield made
    for conn, peer in made:
        conn.close()
        peer.close()


def connect(pairs: list) -> tuple[FrameSocket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
    pair = (FrameSocket(ours, LinkLimits()), theirs)
    pairs.append(pair)
    return pair


class Reports:
    """What a watch handed over: (monotonic time, reason) per connection."""

    def __init__(self) -> None:
        self.reasons: list[tuple[float, str]] = []
        self.event = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append((time.monotonic(), reason))
        self.event.set()


@pytest.fixture
def watch() -> Iterator[SilenceWatch]:
    silence = SilenceWatch("test-silence", TIMEOUT_S).start()
    yield silence
    silence.close()


def test_a_peer_that_sends_nothing_is_reported_within_the_timeout(pairs, watch):
    conn, _peer = connect(pairs)
    reports = Reports()
    started = time.monotonic()
    watch.watch(conn, "stage-9", reports)
    assert reports.event.wait(WAIT_S)
    at, reason = reports.reasons[0]
    assert TIMEOUT_S <= at - started <= TIMEOUT_S + CHECK_INTERVAL_S + 0.5
    assert reason.startswith("stage-9 sent nothing for ") and "stopped, or unreachable" in reason
    reports.event.clear()
    assert not reports.event.wait(TIMEOUT_S * 2)  # once only: it is no longer watched


def test_a_peer_that_pings_is_never_reported(pairs, watch):
    conn, peer = connect(pairs)
    pinger = LinkPinger("test-pinger", interval_s=0.1).start()
    pinger.add(FrameSocket(peer))
    reader = threading.Thread(target=lambda: _read_until_closed(conn), daemon=True)
    reader.start()
    reports = Reports()
    watch.watch(conn, "stage-9", reports)
    try:
        assert not reports.event.wait(TIMEOUT_S * 4)
    finally:
        pinger.close()


def test_bytes_waiting_for_a_busy_reader_count_as_heard(pairs, watch):
    conn, peer = connect(pairs)
    peer.sendall(encode_ping(1))  # arrives, but nobody reads it yet
    reports = Reports()
    watch.watch(conn, "stage-9", reports)
    assert not reports.event.wait(TIMEOUT_S * 3)
    assert conn.read() is not None  # the reader catches up: from now on it is silence
    read_at = time.monotonic()
    assert reports.event.wait(WAIT_S)
    assert reports.reasons[0][0] - read_at >= TIMEOUT_S


def test_a_forgotten_connection_is_never_reported(pairs, watch):
    conn, _peer = connect(pairs)
    reports = Reports()
    watch.watch(conn, "stage-9", reports)
    watch.forget(conn)
    assert not reports.event.wait(TIMEOUT_S * 3)


def test_a_connection_whose_peer_reads_nothing_holds_back_no_other_pings(pairs):
    stuck, _stuck_peer = connect(pairs)
    _fill_send_buffer(stuck)
    live, live_peer = connect(pairs)
    pinger = LinkPinger("test-pinger", interval_s=0.1).start()
    try:
        pinger.add(stuck)  # its first PING blocks in sendall for good
        pinger.add(live)
        peer = FrameSocket(live_peer)
        peer.sock.settimeout(WAIT_S)
        started = time.monotonic()
        for _ in range(5):
            assert peer.read() is not None
        assert time.monotonic() - started < 3.0
    finally:
        pinger.close()
        stuck.close()  # unblocks the stuck PING


def test_link_silence_timeout_s_defaults_to_the_watch_and_refuses_less_than_two_pings():
    later = {"stage": {"id": "stage-1", "index": 1, "layer_start": 15},
             "link": {"listen": "127.0.0.1:9102", "secret": "s" * 20},
             "upstream": {"stage_id": "stage-0", "endpoint": "127.0.0.1:9101"}}
    assert parse_config(later).link.silence_timeout_s == SILENCE_TIMEOUT_S
    later["link"]["silence_timeout_s"] = 0.5
    with pytest.raises(ConfigError) as info:
        parse_config(later)
    assert str(info.value.issues[0]).startswith("link.silence_timeout_s")
    with pytest.raises(ValueError, match="timeout_s"):
        SilenceWatch("bad", 0.0)


def _read_until_closed(conn: FrameSocket) -> None:
    try:
        while conn.read() is not None:
            pass
    except OSError:
        pass


def _fill_send_buffer(conn: FrameSocket) -> None:
    """Write until the kernel takes no more: the peer reads nothing."""
    sock = conn.sock
    assert isinstance(sock, socket.socket)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.setblocking(False)
    try:
        while True:
            sock.send(b"\0" * 65536)
    except BlockingIOError:
        pass
    finally:
        sock.setblocking(True)
