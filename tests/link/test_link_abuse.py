"""Hostile or broken peers on a real stage's link port: each is refused with a logged
reason, the connection is closed, and the pipeline keeps serving requests."""

from __future__ import annotations

import socket

import pytest
from link_support import SECRET

from skippyd.engine.runtime.pipeline_types import ChainEntry
from skippyd.link.dialer import dial
from skippyd.link.framing import FrameSocket
from skippyd.link.handshake import Hello, Role, dial_handshake
from skippyd.link.wire import (
    HEADER,
    FrameKind,
    LinkProtocolError,
    encode_iteration,
)

pytestmark = pytest.mark.model

N_EMBD = 576


def _address(chain) -> tuple[str, int]:
    return "127.0.0.1", chain.ports[1]


def _chain_hello(chain) -> Hello:
    return Hello(Role.CHAIN, 0xABCD, N_EMBD, 0, 15, chain.head.model)


def _closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True once the peer closed the connection (EOF or reset)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def _still_serves(chain) -> None:
    text = chain.client().completions.create(model="any", prompt="The capital of France is",
                                             max_tokens=4, temperature=0).choices[0].text
    assert "Paris" in text
    assert chain.stages[1].proc.poll() is None


def test_wrong_secret_is_rejected_and_logged(chain2):
    conn = FrameSocket(socket.create_connection(_address(chain2)))
    with pytest.raises(LinkProtocolError, match="closed during the handshake"):
        dial_handshake(conn, b"this-is-not-the-secret-at-all", _chain_hello(chain2))
    conn.close()
    chain2.stages[1].wait_for_line(r"rejected: wrong or missing link secret")
    _still_serves(chain2)


def test_garbage_bytes_are_rejected_and_logged(chain2):
    with socket.create_connection(_address(chain2)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)))
        assert _closed_by_peer(sock)
    chain2.stages[1].wait_for_line(r"rejected: bad handshake: unknown frame kind 8239")
    _still_serves(chain2)


def test_truncated_frame_closes_the_connection(chain2):
    conn, _ack = dial(_address(chain2), SECRET.encode(), _chain_hello(chain2))
    entry = ChainEntry(session_id=1, first_position=0, token_ids=[1, 2, 3])
    frame = encode_iteration(7, entry, end_of_batch=True)
    conn.sock.sendall(HEADER.pack(1000, *HEADER.unpack(frame[:HEADER.size])[1:]) + frame[36:46])
    conn.sock.shutdown(socket.SHUT_WR)
    assert _closed_by_peer(conn.sock)
    conn.close()
    chain2.stages[1].wait_for_line(r"closing chain connection .*truncated ITERATION frame "
                                   r"\(10 of 1000 body bytes\)")
    _still_serves(chain2)


def test_oversized_frame_is_refused_before_its_body(chain2):
    conn, _ack = dial(_address(chain2), SECRET.encode(), _chain_hello(chain2))
    conn.sock.sendall(HEADER.pack(0xFFFFFFFF, int(FrameKind.ITERATION), 0, 1, 1, 0, 1, N_EMBD))
    assert _closed_by_peer(conn.sock)
    conn.close()
    chain2.stages[1].wait_for_line(r"ITERATION frame body of 4294967295 bytes exceeds the "
                                   r"\d+-byte limit")
    _still_serves(chain2)


def test_mismatched_topology_is_refused_with_a_reason(chain2):
    hello = Hello(Role.CHAIN, 0xBEEF, N_EMBD, 0, 10, chain2.head.model)
    with pytest.raises(LinkProtocolError, match="upstream ends at layer 10, this stage "
                                                "starts at 15"):
        dial(_address(chain2), SECRET.encode(), hello)
    _still_serves(chain2)


def test_a_chain_beyond_max_chains_is_refused(chain2):
    first, _ack = dial(_address(chain2), SECRET.encode(), _chain_hello(chain2))
    try:
        hello = Hello(Role.CHAIN, 0xFEED, N_EMBD, 0, 15, chain2.head.model)
        with pytest.raises(LinkProtocolError, match=r"already serves link\.max_chains=2"):
            dial(_address(chain2), SECRET.encode(), hello)
    finally:
        first.close()
    _still_serves(chain2)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_activations_are_a_protocol_error(chain2, poison):
    import numpy as np

    conn, _ack = dial(_address(chain2), SECRET.encode(), _chain_hello(chain2))
    rows = np.zeros((2, N_EMBD), dtype=np.float32)
    rows[1, 7] = poison
    entry = ChainEntry(session_id=3, first_position=0, token_ids=[1, 2], rows=rows)
    conn.sock.sendall(encode_iteration(11, entry, end_of_batch=True))
    assert _closed_by_peer(conn.sock)
    conn.close()
    chain2.stages[1].wait_for_line(r"activation rows must be finite")
    _still_serves(chain2)


def test_a_huge_penalty_window_is_a_protocol_error(chain2):
    from skippyd.engine.runtime.contract import SamplingConfig

    conn, _ack = dial(_address(chain2), SECRET.encode(), _chain_hello(chain2))
    sampling = SamplingConfig(repeat_penalty=1.3, penalty_last_n=2**26)
    entry = ChainEntry(session_id=4, first_position=0, token_ids=[1],
                       rows=__import__("numpy").zeros((1, N_EMBD), dtype="float32"),
                       sampling=sampling, sample_last=True)
    conn.sock.sendall(encode_iteration(12, entry, end_of_batch=True))
    assert _closed_by_peer(conn.sock)
    conn.close()
    chain2.stages[1].wait_for_line(r"penalty_last_n: must be at most the context size")
    _still_serves(chain2)
