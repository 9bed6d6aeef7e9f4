"""The stage link wire format: frames, codec, limits and the typed protocol error.

Every message between two stages is one frame: a fixed 36-byte little-endian header
followed by ``body_bytes`` of body (layouts in ``docs/stage-protocol.md``). The reader
validates the header before it reads a body, so an oversized or malformed frame is
refused without buffering it; anything wrong raises :class:`LinkProtocolError`, and
the connection that sent it is closed (explicit limits, typed errors).
The handshake that authenticates a connection lives in ``handshake``, reading and
writing frames on sockets in ``framing``.
"""

from __future__ import annotations

import enum
import logging
import struct
from dataclasses import dataclass, replace

import numpy as np

from skippyd.engine.runtime.contract import LLAMA_MAX_SEQ, MAX_LOGIT_BIAS, SamplingConfig
from skippyd.engine.runtime.pipeline_types import ChainEntry, ChainSample
from skippyd.engine.worker.settings import MAX_NATIVE_ITERATION_TOKENS

logger = logging.getLogger(__name__)

#: Bumped on any incompatible change of a frame layout or of the handshake.
PROTOCOL_VERSION = 5
MAGIC = b"SKPL"
#: body_bytes u32, kind u16, flags u16, session_id u64, request_id u64,
#: first_position i32, token_count u32, row_width u32.
HEADER = struct.Struct("<IHHQQiII")
HEADER_BYTES = HEADER.size
MAX_TEXT_BYTES = 4096
MAX_STATUS_BYTES = 64 * 1024
#: Most entries in one batch: llama.cpp's sequence limit.
MAX_BATCH_ENTRIES = LLAMA_MAX_SEQ

# Sampling block: 7 f64 (temperature, top_p, min_p, typical_p, repeat_penalty,
# presence_penalty, frequency_penalty), top_k i32, penalty_last_n i32, seed u64,
# sampling flags u8, reserved u8, logit-bias count u16; then count x (i32, f64).
_SAMPLING = struct.Struct("<7diiQBBH")
_BIAS = struct.Struct("<id")
_SAMPLING_HAS_SEED = 1
_SAMPLING_IGNORE_EOS = 2
_RESULT = struct.Struct("<IiI")
_RESULT_EOG = 1
#: The record is a token accepted after the previous record's (a verified draft).
_RESULT_FOLLOWS = 2
#: Bits 8-15 of an entry's first record: the drafts the entry carried.
_RESULT_DRAFTED_SHIFT = 8
_RESULT_FLAGS = _RESULT_EOG | _RESULT_FOLLOWS | 0xFF << _RESULT_DRAFTED_SHIFT
#: Most drafts one entry may carry (the ``speculative.max_draft`` bound).
MAX_DRAFTS = 64
_DRAFT_COUNT = struct.Struct("<I")
_LANE = struct.Struct("<I")


class FrameKind(enum.IntEnum):
    """Frame kinds (``kind`` header field)."""

    CHALLENGE = 1
    HELLO = 2
    HELLO_ACK = 3
    REFUSE = 4
    ITERATION = 10
    DROP = 11
    ERROR = 12
    PING = 13
    PONG = 14
    RESULT = 20
    STATUS = 30


class FrameFlag(enum.IntFlag):
    """ITERATION flags (``flags`` header field); other kinds carry none."""

    POSITIONS = 1 << 0
    SAMPLING = 1 << 1
    SAMPLE_LAST = 1 << 2
    END_OF_BATCH = 1 << 3
    DECODE = 1 << 4
    ROWS_F16 = 1 << 5
    DRAFTS = 1 << 6
    LANE = 1 << 7


#: Kinds whose body has a small fixed bound, refused above it before any body is read.
_MAX_BODY_BYTES = {
    FrameKind.DROP: 0, FrameKind.ERROR: MAX_TEXT_BYTES, FrameKind.REFUSE: MAX_TEXT_BYTES,
    FrameKind.STATUS: MAX_STATUS_BYTES,
    FrameKind.RESULT: MAX_BATCH_ENTRIES * (1 + MAX_DRAFTS) * _RESULT.size,
}
_ALL_FLAGS = int(FrameFlag.POSITIONS | FrameFlag.SAMPLING | FrameFlag.SAMPLE_LAST
                 | FrameFlag.END_OF_BATCH | FrameFlag.DECODE | FrameFlag.ROWS_F16
                 | FrameFlag.DRAFTS | FrameFlag.LANE)
#: Largest magnitude float16 holds; a frame with a larger value travels as float32.
F16_MAX = float(np.finfo(np.float16).max)
_KINDS = {int(kind): kind for kind in FrameKind}


class LinkProtocolError(Exception):
    """A peer broke the stage link protocol; the connection must be closed."""


class LinkAuthError(LinkProtocolError):
    """The peer does not know the pipeline's shared secret."""


class LinkRefusedError(LinkProtocolError):
    """The peer authenticated but refused the connection (reason in the message)."""


@dataclass(frozen=True, slots=True)
class LinkLimits:
    """What a reader accepts; everything beyond is a :class:`LinkProtocolError`."""

    max_frame_bytes: int = 64 << 20
    """Largest body (config ``link.max_frame_bytes``)."""
    row_width: int = 0
    """Values per activation row agreed at the handshake; 0 refuses rows."""
    max_tokens: int = MAX_NATIVE_ITERATION_TOKENS
    """Most tokens in one ITERATION frame."""
    max_context_tokens: int = 1 << 24
    """The stage's KV pool: positions and ``penalty_last_n`` must stay within it."""


#: Before authentication a peer may send only a small HELLO.
HANDSHAKE_LIMITS = LinkLimits(max_frame_bytes=4096)


@dataclass(frozen=True, slots=True)
class FrameHeader:
    body_bytes: int
    kind: FrameKind
    flags: int
    session_id: int
    request_id: int
    first_position: int
    token_count: int
    row_width: int


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded frame: its header and the kind-specific payload.

    ``payload`` is a :class:`ChainEntry` (ITERATION), a tuple of :class:`ChainSample`
    (RESULT), ``str`` (ERROR, REFUSE), ``bytes`` (handshake kinds, STATUS) or None (DROP).
    """

    header: FrameHeader
    payload: object

    @property
    def kind(self) -> FrameKind:
        return self.header.kind


# -- encoding ------------------------------------------------------------------------------


def encode_frame(kind: FrameKind, body: bytes = b"", *, flags: int = 0, session_id: int = 0,
                 request_id: int = 0, first_position: int = 0, token_count: int = 0,
                 row_width: int = 0) -> bytes:
    """One frame as bytes (header + body)."""
    header = HEADER.pack(len(body), int(kind), flags, session_id, request_id, first_position,
                         token_count, row_width)
    return header + body


def encode_sampling(config: SamplingConfig) -> bytes:
    """The sampling block of an ITERATION frame."""
    flags = (_SAMPLING_HAS_SEED if config.seed is not None else 0) | (
        _SAMPLING_IGNORE_EOS if config.ignore_eos else 0)
    head = _SAMPLING.pack(config.temperature, config.top_p, config.min_p, config.typical_p,
                          config.repeat_penalty, config.presence_penalty,
                          config.frequency_penalty, config.top_k, config.penalty_last_n,
                          (config.seed or 0) & 0xFFFFFFFFFFFFFFFF, flags, 0,
                          len(config.logit_bias))
    return head + b"".join(_BIAS.pack(t, b) for t, b in config.logit_bias)


def encode_iteration(request_id: int, entry: ChainEntry, *, end_of_batch: bool,
                     half_rows: bool = False) -> bytes:
    """One session's share of a batch as an ITERATION frame.

    ``half_rows`` sends the activation rows as float16 (half the bytes, not exact);
    a frame whose rows exceed float16's range goes as float32 all the same.
    """
    count = len(entry.token_ids)
    tokens = np.asarray(entry.token_ids, dtype="<i4")
    parts = [tokens.tobytes()]
    flags = FrameFlag.END_OF_BATCH if end_of_batch else FrameFlag(0)
    if entry.has_positions:
        flags |= FrameFlag.POSITIONS
        parts.append(np.arange(entry.first_position, entry.first_position + count,
                               dtype="<i4").tobytes())
    if entry.sampling is not None:
        flags |= FrameFlag.SAMPLING
        parts.append(encode_sampling(entry.sampling))
    width = 0
    if entry.rows is not None:
        rows = np.ascontiguousarray(entry.rows, dtype="<f4")
        width = int(rows.shape[1])
        if half_rows and rows.size and float(np.abs(rows).max()) <= F16_MAX:
            flags |= FrameFlag.ROWS_F16
            rows = rows.astype("<f2")
        parts.append(rows.tobytes())
    if entry.draft_count:
        flags |= FrameFlag.DRAFTS
        parts.append(_DRAFT_COUNT.pack(entry.draft_count))
    if entry.lane is not None:
        flags |= FrameFlag.LANE
        parts.append(_LANE.pack(entry.lane))
    flags |= (FrameFlag.SAMPLE_LAST if entry.sample_last else 0) | (
        FrameFlag.DECODE if entry.decode else 0)
    return encode_frame(FrameKind.ITERATION, b"".join(parts), flags=int(flags),
                        session_id=entry.session_id, request_id=request_id,
                        first_position=entry.first_position, token_count=count,
                        row_width=width)


def encode_result(request_id: int, samples: list[ChainSample]) -> bytes:
    """A RESULT: per sample one record, then one per token it accepted after it."""
    records = []
    for s in samples:
        records.append(_RESULT.pack(s.index, s.token, (_RESULT_EOG if s.is_eog else 0)
                                    | s.drafted << _RESULT_DRAFTED_SHIFT))
        records.extend(_RESULT.pack(s.index, token, _RESULT_FOLLOWS
                                    | (_RESULT_EOG if is_eog else 0))
                       for token, is_eog in s.followers)
    return encode_frame(FrameKind.RESULT, b"".join(records), request_id=request_id,
                        token_count=len(records))


def encode_text(kind: FrameKind, text: str, *, request_id: int = 0) -> bytes:
    """An ERROR or REFUSE frame; the text is cut to :data:`MAX_TEXT_BYTES`."""
    body = text.encode("utf-8", errors="replace")[:MAX_TEXT_BYTES]
    return encode_frame(kind, body, request_id=request_id)


def encode_drop(session_id: int) -> bytes:
    return encode_frame(FrameKind.DROP, session_id=session_id)


def encode_ping(nonce: int) -> bytes:
    """A PING; ``nonce`` (the sender's clock) comes back in the PONG."""
    return encode_frame(FrameKind.PING, request_id=nonce)


def encode_pong(nonce: int) -> bytes:
    return encode_frame(FrameKind.PONG, request_id=nonce)


# -- decoding ------------------------------------------------------------------------------


def decode_header(data: bytes | bytearray | memoryview, limits: LinkLimits) -> FrameHeader:
    """Parse and check a header (reject before reading the body).

    Raises:
        LinkProtocolError: Unknown kind, oversized body, or a field out of range.
    """
    if len(data) != HEADER_BYTES:
        raise LinkProtocolError(f"truncated frame header ({len(data)} of {HEADER_BYTES} bytes)")
    body_bytes, kind, flags, session_id, request_id, first, count, width = HEADER.unpack(data)
    if kind not in _KINDS:
        raise LinkProtocolError(f"unknown frame kind {kind}")
    frame_kind = _KINDS[kind]
    if body_bytes > limits.max_frame_bytes:
        raise LinkProtocolError(f"{frame_kind.name} frame body of {body_bytes} bytes exceeds "
                                f"the {limits.max_frame_bytes}-byte limit")
    if body_bytes > _MAX_BODY_BYTES.get(frame_kind, body_bytes):
        raise LinkProtocolError(f"{frame_kind.name} frame body of {body_bytes} bytes exceeds "
                                f"the {_MAX_BODY_BYTES[frame_kind]} bytes such a frame can need")
    if frame_kind is FrameKind.ITERATION:
        _check_iteration_header(body_bytes, flags, first, count, width, limits)
    elif flags or width or first or (count and frame_kind is not FrameKind.RESULT):
        raise LinkProtocolError(f"{frame_kind.name} frame: flags, first_position, "
                                "token_count and row_width must be 0")
    return FrameHeader(body_bytes, frame_kind, flags, session_id, request_id, first, count,
                       width)


def _check_iteration_header(body_bytes: int, flags: int, first: int, count: int, width: int,
                            limits: LinkLimits) -> None:
    if flags & ~_ALL_FLAGS:
        raise LinkProtocolError(f"ITERATION frame: unknown flags {flags & ~_ALL_FLAGS:#x}")
    if first < 0:
        raise LinkProtocolError(f"ITERATION frame: first_position {first} is negative")
    if not 1 <= count <= limits.max_tokens:
        raise LinkProtocolError(f"ITERATION frame: token_count {count} outside "
                                f"1..{limits.max_tokens}")
    if first + count > limits.max_context_tokens:
        raise LinkProtocolError(f"ITERATION frame: first_position {first} + token_count "
                                f"{count} exceeds the {limits.max_context_tokens}-token context")
    if width not in (0, limits.row_width):
        raise LinkProtocolError(f"ITERATION frame: row_width {width}, expected "
                                f"{limits.row_width} (agreed at the handshake)")
    if flags & FrameFlag.ROWS_F16 and not width:
        raise LinkProtocolError("ITERATION frame: ROWS_F16 flag without rows")
    if flags & FrameFlag.DRAFTS and not flags & FrameFlag.SAMPLE_LAST:
        raise LinkProtocolError("ITERATION frame: DRAFTS flag without SAMPLE_LAST")
    # Tokens, positions and rows, one sampling block, a draft count and a lane: nothing
    # may claim more.
    most = (4 * count * (2 + width) + _SAMPLING.size + MAX_LOGIT_BIAS * _BIAS.size
            + _DRAFT_COUNT.size + _LANE.size)
    if body_bytes > most:
        raise LinkProtocolError(f"ITERATION frame: body_bytes {body_bytes} exceeds the "
                                f"{most} bytes {count} tokens of width {width} can need")


def decode_body(header: FrameHeader, body: bytes | bytearray,
                max_context_tokens: int | None = None) -> Frame:
    """Decode a body whose header :func:`decode_header` accepted.

    ``max_context_tokens`` caps ``penalty_last_n`` in a sampling block (the reader's
    :attr:`LinkLimits.max_context_tokens`; None: no cap beyond the type's).

    Raises:
        LinkProtocolError: The body does not match the header or a field is invalid.
    """
    if len(body) != header.body_bytes:
        raise LinkProtocolError(f"truncated {header.kind.name} frame "
                                f"({len(body)} of {header.body_bytes} body bytes)")
    kind = header.kind
    if kind is FrameKind.ITERATION:
        return Frame(header, _decode_iteration(header, body, max_context_tokens))
    if kind is FrameKind.RESULT:
        return Frame(header, _decode_result(header, body))
    if kind in (FrameKind.DROP, FrameKind.PING, FrameKind.PONG):
        if body:
            raise LinkProtocolError(f"{kind.name} frame must have no body")
        return Frame(header, None)
    if kind in (FrameKind.ERROR, FrameKind.REFUSE):
        if len(body) > MAX_TEXT_BYTES:
            raise LinkProtocolError(f"{kind.name} text longer than {MAX_TEXT_BYTES} bytes")
        return Frame(header, bytes(body).decode("utf-8", errors="replace"))
    if kind is FrameKind.STATUS and len(body) > MAX_STATUS_BYTES:
        raise LinkProtocolError(f"STATUS body longer than {MAX_STATUS_BYTES} bytes")
    return Frame(header, bytes(body))


def _decode_iteration(header: FrameHeader, body: bytes | bytearray,
                      max_context_tokens: int | None) -> ChainEntry:
    count, width, flags = header.token_count, header.row_width, header.flags
    offset = 4 * count
    positions_bytes = 4 * count if flags & FrameFlag.POSITIONS else 0
    row_value_bytes = 2 if flags & FrameFlag.ROWS_F16 else 4
    rows_bytes = row_value_bytes * count * width
    drafts_bytes = _DRAFT_COUNT.size if flags & FrameFlag.DRAFTS else 0
    lane_bytes = _LANE.size if flags & FrameFlag.LANE else 0
    sampling_bytes = (len(body) - offset - positions_bytes - rows_bytes - drafts_bytes
                      - lane_bytes)
    has_sampling = bool(flags & FrameFlag.SAMPLING)
    if sampling_bytes < 0 or (not has_sampling and sampling_bytes):
        raise LinkProtocolError(f"ITERATION frame body is {len(body)} bytes, which does not "
                                f"match {count} tokens of width {width}")
    tokens = np.frombuffer(body, dtype="<i4", count=count)
    if (tokens < 0).any():
        raise LinkProtocolError("ITERATION frame: negative token id")
    if positions_bytes:
        positions = np.frombuffer(body, dtype="<i4", count=count, offset=offset)
        if (positions != np.arange(header.first_position, header.first_position + count)).any():
            raise LinkProtocolError("ITERATION frame: positions must count up from "
                                    "first_position")
        offset += positions_bytes
    sampling = None
    if has_sampling:
        sampling = decode_sampling(bytes(body[offset:offset + sampling_bytes]),
                                   max_context_tokens)
        offset += sampling_bytes
    rows = None
    if width:
        dtype = "<f2" if row_value_bytes == 2 else "<f4"
        rows = np.frombuffer(body, dtype=dtype, count=count * width,
                             offset=offset).reshape(count, width)
        if row_value_bytes == 2:
            rows = rows.astype(np.float32)
        if not np.isfinite(rows).all():
            # NaN or Inf would flow through every later layer and come out as tokens.
            raise LinkProtocolError("ITERATION frame: activation rows must be finite "
                                    "(NaN or Inf found)")
        offset += row_value_bytes * count * width
    draft_count = 0
    if drafts_bytes:
        (draft_count,) = _DRAFT_COUNT.unpack_from(body, offset)
        if not 1 <= draft_count <= min(MAX_DRAFTS, count - 1):
            raise LinkProtocolError(f"ITERATION frame: {draft_count} drafts in {count} "
                                    f"tokens (1..{min(MAX_DRAFTS, count - 1)})")
        offset += drafts_bytes
    lane = None
    if lane_bytes:
        (lane,) = _LANE.unpack_from(body, offset)
        if lane >= LLAMA_MAX_SEQ:
            raise LinkProtocolError(f"ITERATION frame: lane {lane} beyond llama.cpp's "
                                    f"{LLAMA_MAX_SEQ} sequences")
    return ChainEntry(
        session_id=header.session_id, first_position=header.first_position,
        token_ids=tokens.tolist(), rows=rows, sampling=sampling,
        sample_last=bool(flags & FrameFlag.SAMPLE_LAST), decode=bool(flags & FrameFlag.DECODE),
        has_positions=bool(positions_bytes), draft_count=draft_count, lane=lane,
    )


def decode_sampling(block: bytes, max_context_tokens: int | None = None) -> SamplingConfig:
    """Parse a sampling block; it must be exactly one block long.

    ``penalty_last_n`` sizes the penalty sampler's history: it may not exceed
    ``max_context_tokens`` (the receiving stage's context).

    Raises:
        LinkProtocolError: Wrong size, too many logit biases, or an invalid value.
    """
    if len(block) < _SAMPLING.size:
        raise LinkProtocolError(f"sampling block of {len(block)} bytes is too short")
    (temperature, top_p, min_p, typical_p, repeat_penalty, presence, frequency, top_k,
     last_n, seed, flags, _reserved, n_bias) = _SAMPLING.unpack_from(block)
    if n_bias > MAX_LOGIT_BIAS or len(block) != _SAMPLING.size + n_bias * _BIAS.size:
        raise LinkProtocolError(f"sampling block: {n_bias} logit biases do not fit "
                                f"{len(block)} bytes (at most {MAX_LOGIT_BIAS})")
    bias = tuple(_BIAS.unpack_from(block, _SAMPLING.size + i * _BIAS.size)
                 for i in range(n_bias))
    config = SamplingConfig(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
        repeat_penalty=repeat_penalty, presence_penalty=presence, frequency_penalty=frequency,
        penalty_last_n=last_n, seed=seed if flags & _SAMPLING_HAS_SEED else None,
        logit_bias=bias, ignore_eos=bool(flags & _SAMPLING_IGNORE_EOS),
    )
    values = (temperature, top_p, min_p, typical_p, repeat_penalty, presence, frequency,
              *(b for _, b in bias))
    if not all(np.isfinite(values)):
        raise LinkProtocolError("sampling block: values must be finite")
    try:
        config.validate(n_ctx=max_context_tokens)
    except ValueError as exc:
        raise LinkProtocolError(f"sampling block: {exc}") from None
    return config


def _decode_result(header: FrameHeader, body: bytes | bytearray) -> tuple[ChainSample, ...]:
    count = header.token_count
    most = MAX_BATCH_ENTRIES * (1 + MAX_DRAFTS)
    if count > most or len(body) != count * _RESULT.size:
        raise LinkProtocolError(f"RESULT frame: {count} records do not fit {len(body)} bytes "
                                f"(at most {most})")
    samples: list[ChainSample] = []
    followers: list[tuple[int, bool]] = []

    def close_sample() -> None:
        if followers:
            samples[-1] = replace(samples[-1], followers=tuple(followers))
            followers.clear()

    for i in range(count):
        index, token, flags = _RESULT.unpack_from(body, i * _RESULT.size)
        drafted = flags >> _RESULT_DRAFTED_SHIFT & 0xFF
        follows = bool(flags & _RESULT_FOLLOWS)
        if (index >= MAX_BATCH_ENTRIES or token < 0 or flags & ~_RESULT_FLAGS
                or (follows and (drafted or not samples or samples[-1].index != index
                                 or len(followers) >= samples[-1].drafted))
                or drafted > MAX_DRAFTS):
            raise LinkProtocolError(f"RESULT frame: bad record {i} (index {index}, "
                                    f"token {token}, flags {flags:#x})")
        if follows:
            followers.append((token, bool(flags & _RESULT_EOG)))
            continue
        close_sample()
        samples.append(ChainSample(index, token, bool(flags & _RESULT_EOG), drafted=drafted))
    close_sample()
    return tuple(samples)


def decode_stream(data: bytes, limits: LinkLimits) -> list[Frame]:
    """Decode consecutive frames filling ``data`` exactly (tests and tools).

    Raises:
        LinkProtocolError: Any malformed or truncated frame.
    """
    frames = []
    offset = 0
    while offset < len(data):
        header = decode_header(data[offset:offset + HEADER_BYTES], limits)
        start = offset + HEADER_BYTES
        frames.append(decode_body(header, data[start:start + header.body_bytes],
                                  limits.max_context_tokens))
        offset = start + header.body_bytes
    return frames
