"""A real link listener under handshake abuse: slots, deadlines, credentials, logs.

A stage-0 listener (no worker: it answers STATUS only) on a loopback port; hostile
peers are raw sockets, the honest one is ``query_status``.
"""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from skippyd.link import listener as listener_module
from skippyd.link.dialer import query_status
from skippyd.link.listener import (
    MAX_PENDING_HANDSHAKES,
    PendingHandshakes,
    StageFacts,
    StageLinkServer,
)
from skippyd.link.wire import FrameKind, LinkAuthError, LinkProtocolError, encode_frame

SECRET = b"listener-test-secret-0123456789"
STATUS_SECRET = b"listener-test-read-only-credential"
WAIT_S = 10.0


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(listener_module, "HANDSHAKE_TIMEOUT_S", 1.0)
    facts = StageFacts(stage_id="s0", stage_index=0, layer_start=0, layer_end=2,
                       model_id="m", n_embd=8, lanes=2, session_tokens=64,
                       max_batch_tokens=64, is_first=True, is_final=False, secret=SECRET,
                       max_frame_bytes=1 << 20, status_secret=STATUS_SECRET)
    link = StageLinkServer(facts, None, status=lambda: {"probe": 1})
    address = link.bind(("127.0.0.1", 0))
    link.start()
    yield link, address
    link.close()


class Dripper(threading.Thread):
    """Connects and sends a HELLO one byte every ``every_s`` until closed or stopped."""

    def __init__(self, address, every_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(address)
        self.every_s = every_s
        self.stop = threading.Event()
        self.closed = threading.Event()
        self.frame = encode_frame(FrameKind.HELLO, b"h" * 200)
        self.sent = 0

    def run(self) -> None:
        try:
            for byte in self.frame:
                if self.stop.wait(self.every_s):
                    return
                self.sock.sendall(bytes([byte]))
                self.sent += 1
        except OSError:
            pass
        finally:
            self.closed.set()

    def finish(self) -> None:
        self.stop.set()
        self.join(WAIT_S)
        self.sock.close()


def _peer_closed(sock: socket.socket) -> bool:
    sock.settimeout(WAIT_S)
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass
    return True


def test_dripping_peers_never_lock_the_handshake_out(server):
    link, address = server
    drippers = [Dripper(address) for _ in range(MAX_PENDING_HANDSHAKES + 4)]
    for dripper in drippers:
        dripper.start()
    try:
        for _ in range(3):  # an honest peer gets in, again and again, while they drip
            assert query_status(address, SECRET)["probe"] == 1
    finally:
        for dripper in drippers:
            dripper.finish()


def test_a_dripped_handshake_is_cut_at_its_absolute_deadline(server):
    _, address = server
    dripper = Dripper(address, every_s=0.05)  # each byte well within a per-read timeout
    dripper.start()
    try:
        assert _peer_closed(dripper.sock)
        # Cut long before the whole HELLO (12 s of bytes) could have arrived.
        assert dripper.sent < len(dripper.frame) // 2
    finally:
        dripper.finish()


def test_the_read_only_credential_reads_status_and_nothing_else(server):
    _, address = server
    assert query_status(address, STATUS_SECRET)["probe"] == 1
    from skippyd.link.dialer import dial
    from skippyd.link.handshake import Hello, Role

    with pytest.raises(LinkProtocolError):
        dial(address, STATUS_SECRET, Hello(Role.CHAIN, 1, 8, 0, 2, "m"))
    with pytest.raises(LinkProtocolError):
        query_status(address, b"not-the-secret-nor-the-credential")
    assert not issubclass(LinkAuthError, OSError)


def test_rejections_are_logged_but_rate_limited(server, caplog):
    _, address = server
    with caplog.at_level(logging.WARNING, logger="skippyd.link.listener"):
        for _ in range(30):
            with pytest.raises(LinkProtocolError):
                query_status(address, b"wrong-secret-wrong-secret-wrong")
    lines = [r.getMessage() for r in caplog.records if "wrong or missing" in r.getMessage()]
    assert 1 <= len(lines) <= 2


def test_pending_handshakes_make_room_oldest_first():
    class Conn:
        def __init__(self) -> None:
            self.sock = socket.socket()

    pending = PendingHandshakes(capacity=3, per_peer=2)
    a1, a2, a3, b1, c1 = (Conn() for _ in range(5))
    pending.enter(a1, "a")
    pending.enter(a2, "a")
    pending.enter(a3, "a")  # a's share is 2: its oldest gives way
    assert pending.leave(a1) and len(pending) == 2
    pending.enter(b1, "b")
    pending.enter(c1, "c")  # 3 slots in all: the oldest (a2) gives way
    assert pending.leave(a2)
    assert not pending.leave(a3) and not pending.leave(b1) and not pending.leave(c1)
    for conn in (a1, a2, a3, b1, c1):
        conn.sock.close()
