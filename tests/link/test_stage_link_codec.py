"""The stage link wire format and handshake, without a model: round trips, every
rejection rule, and a fuzzed decoder that may only ever raise ``LinkProtocolError``."""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippyd.engine.runtime.contract import SamplingConfig
from skippyd.engine.runtime.pipeline_types import ChainEntry, ChainSample
from skippyd.link.framing import BatchAssembler, FrameSocket
from skippyd.link.handshake import (
    Hello,
    HelloAck,
    Role,
    accept_handshake,
    dial_handshake,
    send_ack,
)
from skippyd.link.wire import (
    HEADER,
    HEADER_BYTES,
    FrameFlag,
    FrameKind,
    LinkAuthError,
    LinkLimits,
    LinkProtocolError,
    LinkRefusedError,
    decode_stream,
    encode_drop,
    encode_frame,
    encode_iteration,
    encode_result,
    encode_text,
)

WIDTH = 8
LIMITS = LinkLimits(max_frame_bytes=1 << 16, row_width=WIDTH, max_tokens=64,
                    max_context_tokens=4096)
SECRET = b"a-test-secret-of-enough-length"
SAMPLING = SamplingConfig(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=2**64 - 1,
                          logit_bias=((3, -1.5), (7, 2.0)), ignore_eos=True)


def _entry(n: int = 3, *, sampling: SamplingConfig | None = SAMPLING, rows: bool = True,
           session_id: int = 5) -> ChainEntry:
    data = np.arange(n * WIDTH, dtype=np.float32).reshape(n, WIDTH) / 7 if rows else None
    return ChainEntry(session_id=session_id, first_position=11, token_ids=list(range(1, n + 1)),
                      rows=data, sampling=sampling, sample_last=True, decode=n == 1)


def _valid_stream() -> bytes:
    return b"".join([
        encode_iteration(9, _entry(session_id=1), end_of_batch=False),
        encode_iteration(9, _entry(1, sampling=None, session_id=2), end_of_batch=True),
        encode_drop(4),
        encode_text(FrameKind.ERROR, "stage-1: no KV slot", request_id=9),
        encode_result(9, [ChainSample(0, 42, False), ChainSample(1, 2, True)]),
    ])


def test_frames_round_trip():
    frames = decode_stream(_valid_stream(), LIMITS)
    assert [f.kind for f in frames] == [FrameKind.ITERATION, FrameKind.ITERATION,
                                        FrameKind.DROP, FrameKind.ERROR, FrameKind.RESULT]
    entry = frames[0].payload
    expected = _entry(session_id=1)
    assert entry.token_ids == expected.token_ids and entry.first_position == 11
    assert entry.sampling == SAMPLING and entry.sample_last and not entry.decode
    np.testing.assert_array_equal(entry.rows, expected.rows)
    assert frames[1].payload.sampling is None and frames[1].payload.decode
    assert frames[2].header.session_id == 4
    assert frames[3].payload == "stage-1: no KV slot" and frames[3].header.request_id == 9
    assert frames[4].payload == (ChainSample(0, 42, False), ChainSample(1, 2, True))


def test_batch_assembler_groups_until_end_of_batch():
    frames = decode_stream(_valid_stream(), LIMITS)
    assembler = BatchAssembler()
    assert assembler.add(frames[0]) is None and assembler.open
    request_id, entries, half_rows = assembler.add(frames[1])
    assert not half_rows
    assert request_id == 9 and [e.session_id for e in entries] == [1, 2]
    assert not assembler.open


@pytest.mark.parametrize("frames, message", [
    ([encode_iteration(1, _entry(session_id=1), end_of_batch=False),
      encode_iteration(2, _entry(session_id=2), end_of_batch=True)], "inside unfinished batch"),
    ([encode_iteration(1, _entry(session_id=1), end_of_batch=False),
      encode_iteration(1, _entry(session_id=1), end_of_batch=True)], "repeats session"),
])
def test_batch_assembler_rejects_mixed_batches(frames, message):
    assembler = BatchAssembler()
    parsed = decode_stream(b"".join(frames), LIMITS)
    assembler.add(parsed[0])
    with pytest.raises(LinkProtocolError, match=message):
        assembler.add(parsed[1])


def _header(kind=FrameKind.ITERATION, body=0, flags=0, first=0, count=1, width=0) -> bytes:
    return HEADER.pack(body, int(kind), flags, 1, 1, first, count, width)


@pytest.mark.parametrize("data, message", [
    (_header(kind=99), "unknown frame kind 99"),
    (_header(body=(1 << 16) + 1), "exceeds the 65536-byte limit"),
    (_header(count=0), "token_count 0 outside"),
    (_header(count=65), "token_count 65 outside"),
    (_header(first=-1), "first_position -1 is negative"),
    (_header(width=WIDTH + 1), "row_width 9, expected 8"),
    (_header(first=4090, count=7), "exceeds the 4096-token context"),
    (_header(body=60_000, count=2, width=WIDTH), "body_bytes 60000 exceeds"),
    (_header(flags=1 << 9), "unknown flags"),
    (_header(kind=FrameKind.DROP, count=3), "must be 0"),
    (_header(body=8)[:-3], "truncated frame header"),
    (_header(body=8) + b"\0" * 4, "truncated ITERATION frame"),
    (_header(body=5, count=1) + b"\0" * 5, "does not match 1 tokens"),
    (_header(kind=FrameKind.RESULT, body=12, count=2) + b"\0" * 12, "2 records do not fit"),
    (_header(kind=FrameKind.DROP, body=1, count=0) + b"x", "DROP frame body of 1 bytes exceeds"),
    (_header(kind=FrameKind.STATUS, body=1 << 16 + 1, count=0), "STATUS frame body of"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_malformed_frames_are_rejected_with_a_reason(data, message):
    with pytest.raises(LinkProtocolError, match=message):
        decode_stream(data, LIMITS)


@pytest.mark.parametrize("sampling, message", [
    (SamplingConfig(temperature=float("nan")), "finite"),
    (SamplingConfig(top_p=1.5), "top_p"),
    (SamplingConfig(logit_bias=((1, float("inf")),)), "finite"),
    (SamplingConfig(repeat_penalty=1.1, penalty_last_n=2**26),
     "penalty_last_n: must be at most the context size 4096"),
])
def test_invalid_sampling_values_are_protocol_errors(sampling, message):
    data = encode_iteration(1, _entry(sampling=sampling), end_of_batch=True)
    with pytest.raises(LinkProtocolError, match=message):
        decode_stream(data, LIMITS)


def test_negative_tokens_and_wrong_positions_are_rejected():
    good = encode_iteration(1, _entry(rows=False, sampling=None), end_of_batch=True)
    bad_token = good[:HEADER_BYTES] + struct.pack("<i", -5) + good[HEADER_BYTES + 4:]
    with pytest.raises(LinkProtocolError, match="negative token id"):
        decode_stream(bad_token, LIMITS)
    at = HEADER_BYTES + 12  # first position in the position sideband
    bad_position = good[:at] + struct.pack("<i", 99) + good[at + 4:]
    with pytest.raises(LinkProtocolError, match="positions must count up"):
        decode_stream(bad_position, LIMITS)


# -- fuzzing: the decoder raises LinkProtocolError and nothing else ---------------------------

def _decode_only_protocol_errors(data: bytes) -> None:
    try:
        decode_stream(data, LIMITS)
    except LinkProtocolError:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(data):
    _decode_only_protocol_errors(data)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutated_valid_frames(data):
    stream = bytearray(_valid_stream())
    for _ in range(data.draw(st.integers(1, 4))):
        action = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        at = data.draw(st.integers(0, len(stream) - 1))
        if action == "flip":
            stream[at] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "set":
            stream[at] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del stream[at:at + data.draw(st.integers(1, 16))]
        else:
            stream[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        if not stream:
            return
    _decode_only_protocol_errors(bytes(stream))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_frame_socket_reader(data):
    left, right = socket.socketpair()
    with left, right:
        right.sendall(data)
        right.shutdown(socket.SHUT_WR)
        reader = FrameSocket(left, LIMITS)
        try:
            while reader.read() is not None:
                pass
        except LinkProtocolError:
            pass


# -- handshake over a real socket pair ----------------------------------------------------------

def _handshake(dial_secret: bytes, *, refuse: str | None = None, role: Role = Role.CHAIN,
               status_secret: bytes | None = None):
    """Run both sides; returns (listener outcome, dialer outcome): a value or an error."""
    left, right = socket.socketpair()
    outcome: dict[str, object] = {}

    def listen():
        conn = FrameSocket(left)
        try:
            hello, server_nonce, client_nonce, secret = accept_handshake(conn, SECRET,
                                                                         status_secret)
            if refuse is not None:
                conn.write(encode_text(FrameKind.REFUSE, refuse))
            else:
                send_ack(conn, secret, (server_nonce, client_nonce),
                         HelloAck(2, 4, 4096, 512, "127.0.0.1:9", "stage-2"))
            outcome["listener"] = hello
        except LinkProtocolError as exc:
            outcome["listener"] = exc
        finally:
            conn.close()

    thread = threading.Thread(target=listen)
    thread.start()
    hello = Hello(role, 77, 576, 0, 15, "model-x")
    try:
        result: object = dial_handshake(FrameSocket(right), dial_secret, hello)
    except LinkProtocolError as exc:
        result = exc
    thread.join(5)
    right.close()
    return outcome["listener"], result


def test_handshake_succeeds_with_the_shared_secret():
    listener, dialer = _handshake(SECRET)
    assert listener == Hello(Role.CHAIN, 77, 576, 0, 15, "model-x")
    assert dialer == HelloAck(2, 4, 4096, 512, "127.0.0.1:9", "stage-2")


def test_handshake_rejects_a_wrong_secret():
    listener, dialer = _handshake(b"not-the-secret-at-all-no")
    assert isinstance(listener, LinkAuthError)
    assert "wrong or missing link secret" in str(listener)
    assert isinstance(dialer, LinkProtocolError) and not isinstance(dialer, LinkAuthError)


def test_handshake_carries_a_refusal_reason():
    _, dialer = _handshake(SECRET, refuse="upstream ends at layer 15, this stage starts at 10")
    assert isinstance(dialer, LinkRefusedError)
    assert "this stage starts at 10" in str(dialer)


def test_a_hello_before_authentication_is_size_limited():
    left, right = socket.socketpair()
    with left, right:
        right.sendall(encode_frame(FrameKind.HELLO, b"\0" * 5000))
        with pytest.raises(LinkProtocolError, match="exceeds the 4096-byte limit"):
            accept_handshake(FrameSocket(left), SECRET)


def test_float16_rows_halve_the_bytes_and_round_trip_within_float16_precision():
    entry = _entry(4)
    full = encode_iteration(3, entry, end_of_batch=True)
    half = encode_iteration(3, entry, end_of_batch=True, half_rows=True)
    assert len(full) - len(half) == 4 * WIDTH * 2
    [frame] = decode_stream(half, LIMITS)
    assert frame.header.flags & FrameFlag.ROWS_F16 and frame.payload.rows.dtype == np.float32
    np.testing.assert_array_equal(frame.payload.rows,
                                  entry.rows.astype(np.float16).astype(np.float32))
    request_id, _, half_rows = BatchAssembler().add(frame)
    assert (request_id, half_rows) == (3, True)  # a middle stage forwards the same way


def test_rows_beyond_float16_range_travel_as_float32():
    entry = _entry(2)
    entry.rows[1, 3] = 1e6
    [frame] = decode_stream(encode_iteration(3, entry, end_of_batch=True, half_rows=True),
                            LIMITS)
    assert not frame.header.flags & FrameFlag.ROWS_F16
    np.testing.assert_array_equal(frame.payload.rows, entry.rows)


def test_a_float16_flag_without_rows_is_refused():
    data = bytearray(encode_iteration(3, _entry(2, rows=False), end_of_batch=True))
    flags = int.from_bytes(data[6:8], "little") | int(FrameFlag.ROWS_F16)
    data[6:8] = flags.to_bytes(2, "little")
    with pytest.raises(LinkProtocolError, match="ROWS_F16 flag without rows"):
        decode_stream(bytes(data), LIMITS)


def test_the_status_credential_opens_status_and_nothing_else():
    status_secret = b"read-only-monitoring-credential"
    listener, dialer = _handshake(status_secret, role=Role.STATUS, status_secret=status_secret)
    assert listener == Hello(Role.STATUS, 77, 576, 0, 15, "model-x")
    assert isinstance(dialer, HelloAck)  # the ack is MAC'd with the status credential
    listener, dialer = _handshake(status_secret, status_secret=status_secret)  # CHAIN
    assert isinstance(listener, LinkAuthError)
    assert "allows the STATUS role only" in str(listener)
    listener, _ = _handshake(status_secret, role=Role.STATUS)  # no credential configured
    assert isinstance(listener, LinkAuthError)


@pytest.mark.parametrize("half_rows", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_activation_rows_must_be_finite(bad, half_rows):
    entry = _entry()
    entry.rows[1, 3] = bad
    data = encode_iteration(1, entry, end_of_batch=True, half_rows=half_rows)
    with pytest.raises(LinkProtocolError, match="activation rows must be finite"):
        decode_stream(data, LIMITS)


def test_float16_rows_are_checked_for_infinity_after_decoding():
    entry = _entry(2)
    data = bytearray(encode_iteration(3, entry, end_of_batch=True, half_rows=True))
    inf16 = np.array([np.inf], dtype="<f2").tobytes()
    data[-2:] = inf16  # the last row value: +Inf in float16, never sent by an honest peer
    with pytest.raises(LinkProtocolError, match="activation rows must be finite"):
        decode_stream(bytes(data), LIMITS)


def test_a_claimed_body_allocates_with_the_bytes_that_arrive():
    import tracemalloc

    left, right = socket.socketpair()
    with left, right:
        # A header claiming 60 MiB, then 10 bytes and the end of the stream.
        right.sendall(HEADER.pack(60 << 20, int(FrameKind.HELLO), 0, 0, 0, 0, 0, 0) + b"x" * 10)
        right.shutdown(socket.SHUT_WR)
        reader = FrameSocket(left, LinkLimits(max_frame_bytes=64 << 20))
        tracemalloc.start()
        try:
            with pytest.raises(LinkProtocolError, match="10 of 62914560 body bytes"):
                reader.read()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 4 << 20


def test_large_bodies_still_arrive_whole():
    left, right = socket.socketpair()
    rows = np.random.default_rng(0).standard_normal((1500, 576)).astype(np.float32)
    entry = ChainEntry(session_id=1, first_position=0, token_ids=[1] * 1500, rows=rows)
    data = encode_iteration(3, entry, end_of_batch=True)  # 3.5 MB, past the eager buffer
    with left, right:
        sender = threading.Thread(target=right.sendall, args=(data,))
        sender.start()
        limits = LinkLimits(max_frame_bytes=64 << 20, row_width=576, max_tokens=2048)
        frame = FrameSocket(left, limits).read()
        sender.join(5)
    np.testing.assert_array_equal(frame.payload.rows, rows)


def test_a_read_deadline_holds_however_the_bytes_trickle(monkeypatch):
    left, right = socket.socketpair()
    with left, right:
        reader = FrameSocket(left)
        reader.sock.settimeout(5.0)  # per recv: each dripped byte would reset it
        reader.deadline = time.monotonic() + 0.3
        stop = threading.Event()

        def drip():
            frame = encode_frame(FrameKind.HELLO, b"h" * 100)
            for byte in frame:
                if stop.wait(0.02):
                    return
                right.sendall(bytes([byte]))

        dripper = threading.Thread(target=drip)
        dripper.start()
        try:
            with pytest.raises(TimeoutError):
                reader.read()
        finally:
            stop.set()
            dripper.join(5)
        assert reader.bytes_in < 136


def test_a_frame_body_has_its_own_deadline():
    left, right = socket.socketpair()
    with left, right:
        reader = FrameSocket(left, LinkLimits(max_frame_bytes=1 << 16))
        reader.body_timeout_s = 0.2
        right.sendall(encode_frame(FrameKind.STATUS, b"s" * 1000)[:HEADER_BYTES + 10])
        with pytest.raises(TimeoutError):
            reader.read()


def test_drafts_and_the_tokens_accepted_after_them_round_trip():
    entry = dataclasses.replace(_entry(5), draft_count=3)
    [frame] = decode_stream(encode_iteration(3, entry, end_of_batch=True, half_rows=True),
                            LIMITS)
    assert frame.header.flags & FrameFlag.DRAFTS and frame.payload.draft_count == 3
    assert frame.payload.token_ids == [1, 2, 3, 4, 5] and frame.payload.sampling == SAMPLING
    samples = [ChainSample(0, 42, False, followers=((7, False), (8, False)), drafted=3),
               ChainSample(1, 9, False),
               ChainSample(2, 4, False, drafted=2),
               ChainSample(3, 5, False, followers=((2, True),), drafted=4)]
    [result] = decode_stream(encode_result(3, samples), LIMITS)
    assert result.header.token_count == 7 and result.payload == tuple(samples)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda e: dataclasses.replace(e, sample_last=False), "DRAFTS flag without SAMPLE_LAST"),
    (lambda e: dataclasses.replace(e, token_ids=[1, 2, 3], rows=e.rows[:3]), "3 drafts in 3"),
])
def test_drafts_without_sampling_or_without_input_are_refused(mutate, message):
    entry = mutate(dataclasses.replace(_entry(5), draft_count=3))
    with pytest.raises(LinkProtocolError, match=message):
        decode_stream(encode_iteration(3, entry, end_of_batch=True), LIMITS)


@pytest.mark.parametrize("samples", [
    [ChainSample(0, 42, False, followers=((7, False), (8, False)), drafted=1)],  # > drafted
])
def test_a_result_with_more_accepted_tokens_than_drafts_is_refused(samples):
    with pytest.raises(LinkProtocolError, match="bad record 2"):
        decode_stream(encode_result(3, samples), LIMITS)


def test_a_follower_record_without_its_sample_is_refused():
    record = struct.pack("<IiI", 0, 7, 2)  # FOLLOWS, but nothing before it
    data = encode_frame(FrameKind.RESULT, record, request_id=3, token_count=1)
    with pytest.raises(LinkProtocolError, match="bad record 0"):
        decode_stream(data, LIMITS)


@pytest.mark.parametrize(("drafts", "half_rows"), [(0, False), (3, True)])
def test_a_lane_round_trips_after_everything_else(drafts, half_rows):
    entry = dataclasses.replace(_entry(5), draft_count=drafts, lane=7)
    [frame] = decode_stream(encode_iteration(3, entry, end_of_batch=True, half_rows=half_rows),
                            LIMITS)
    assert frame.header.flags & FrameFlag.LANE and frame.payload.lane == 7
    assert frame.payload.draft_count == drafts and frame.payload.sampling == SAMPLING
    assert frame.payload.token_ids == [1, 2, 3, 4, 5]
    [plain] = decode_stream(encode_iteration(3, _entry(5), end_of_batch=True), LIMITS)
    assert not plain.header.flags & FrameFlag.LANE and plain.payload.lane is None


def test_a_lane_beyond_llama_cpp_s_sequences_is_refused():
    data = encode_iteration(3, dataclasses.replace(_entry(2), lane=256), end_of_batch=True)
    with pytest.raises(LinkProtocolError, match="lane 256"):
        decode_stream(data, LIMITS)
