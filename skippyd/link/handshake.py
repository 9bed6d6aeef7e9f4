"""The stage link handshake: mutual challenge-response on the pipeline's shared secret.

The listener speaks first with a CHALLENGE (magic, version, 32 random bytes). The
dialer answers with a HELLO whose HMAC-SHA256 covers that nonce, its role and every
field it sends; the listener checks it with ``hmac.compare_digest`` (constant time)
and answers HELLO_ACK, itself MAC'd over the dialer's nonce, or REFUSE
with a reason. The secret never crosses the wire. A peer that fails any step is
disconnected; the caller logs why.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import struct
from dataclasses import dataclass

from skippyd.link.framing import FrameSocket
from skippyd.link.wire import (
    MAGIC,
    PROTOCOL_VERSION,
    FrameKind,
    LinkAuthError,
    LinkProtocolError,
    LinkRefusedError,
    encode_frame,
    encode_text,
)

logger = logging.getLogger(__name__)

#: Unauthenticated peers get this long to finish the handshake.
HANDSHAKE_TIMEOUT_S = 5.0
_DOMAIN = b"skippyd stage link v1\x00"
_CHALLENGE = struct.Struct("<4sHH32s")
# magic, version, role, mac, client nonce, chain id, n_embd, stage index, layer_end,
# model id length; then the model id (UTF-8).
_HELLO = struct.Struct("<4sHH32s16sQIIIH")
# mac, stages from the listener to the end, lanes, ctx, batch tokens, endpoint length,
# stage id length; then the endpoint and the final stage's id (UTF-8).
_ACK = struct.Struct("<32sIIIIHH")
_MAX_NAME_BYTES = 255


class Role(enum.IntEnum):
    """What a dialer wants from the listener."""

    CHAIN = 1
    """Carry batches down the pipeline (stage k-1 to stage k)."""
    RETURN = 2
    """Receive predictions straight from the final stage (stage 0 dials it)."""
    STATUS = 3
    """Read one STATUS frame (JSON counters) and close."""


@dataclass(frozen=True, slots=True)
class Hello:
    """What a dialer tells the listener about itself."""

    role: Role
    chain_id: int = 0
    """Random id of one stage-0 connection attempt; RETURN connections name it."""
    n_embd: int = 0
    """Width of the activation rows the dialer sends."""
    stage_index: int = 0
    layer_end: int = 0
    """One past the dialer's last layer: the listener must start there."""
    model_id: str = ""


@dataclass(frozen=True, slots=True)
class HelloAck:
    """What the listener (and the stages behind it) report back on a CHAIN connection."""

    num_stages: int = 1
    """Stages from the listener to the end of the pipeline, itself included."""
    min_lanes: int = 0
    """Fewest lanes of those stages."""
    min_session_tokens: int = 0
    """Smallest per-session KV capacity of those stages, in tokens (one lane's stream:
    ``runtime.ctx_size / lanes``)."""
    min_batch: int = 0
    """Fewest tokens one iteration may hold on those stages (their ``runtime.n_batch``)."""
    return_endpoint: str = ""
    """Where stage 0 dials the final stage for predictions (``host:port``)."""
    final_stage_id: str = ""


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, _DOMAIN + b"".join(parts), hashlib.sha256).digest()


def _name(text: str, what: str) -> bytes:
    data = text.encode("utf-8")
    if len(data) > _MAX_NAME_BYTES:
        raise ValueError(f"{what} longer than {_MAX_NAME_BYTES} bytes")
    return data


def _utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise LinkProtocolError(f"{what} is not UTF-8") from None


def _expect(frame, kind: FrameKind, step: str) -> bytes:
    if frame is None:
        raise LinkProtocolError(f"connection closed during the handshake ({step})")
    if frame.kind is FrameKind.REFUSE:
        raise LinkRefusedError(f"refused: {frame.payload}")
    if frame.kind is not kind:
        raise LinkProtocolError(f"expected {kind.name} during the handshake, got "
                                f"{frame.kind.name}")
    return frame.payload


# -- listener side -------------------------------------------------------------------------


def accept_handshake(conn: FrameSocket, secret: bytes,
                     status_secret: bytes | None = None) -> tuple[Hello, bytes, bytes, bytes]:
    """Challenge a dialer and authenticate its HELLO.

    Args:
        conn: The new connection.
        secret: The pipeline's data secret: any role.
        status_secret: A read-only credential: the STATUS role only.

    Returns:
        The hello, the server nonce, the client nonce (for :func:`send_ack`) and the
        secret it proved it knows (answer with the same one).

    Raises:
        LinkAuthError: Wrong secret.
        LinkProtocolError: Anything else malformed.
        OSError: The connection failed or timed out.
    """
    nonce = os.urandom(32)
    conn.write(encode_frame(FrameKind.CHALLENGE,
                            _CHALLENGE.pack(MAGIC, PROTOCOL_VERSION, 0, nonce)))
    body = _expect(conn.read(), FrameKind.HELLO, "HELLO")
    if len(body) < _HELLO.size:
        raise LinkProtocolError(f"HELLO of {len(body)} bytes is too short")
    (magic, version, role, mac, client_nonce, chain_id, n_embd, stage_index, layer_end,
     model_len) = _HELLO.unpack_from(body)
    if magic != MAGIC:
        raise LinkProtocolError("HELLO without the skippyd link magic")
    if version != PROTOCOL_VERSION:
        raise LinkProtocolError(f"peer speaks link protocol {version}, this stage speaks "
                                f"{PROTOCOL_VERSION}")
    if len(body) != _HELLO.size + model_len:
        raise LinkProtocolError("HELLO length does not match its model id length")
    signed = body[:8] + body[40:]  # everything but the MAC itself
    used = _proven_secret(mac, _mac(secret, nonce, signed), secret, status_secret,
                          nonce, signed, role)
    if role not in Role._value2member_map_:
        raise LinkProtocolError(f"unknown role {role}")
    hello = Hello(Role(role), chain_id, n_embd, stage_index, layer_end,
                  _utf8(body[_HELLO.size:], "model id"))
    return hello, nonce, client_nonce, used


def _proven_secret(mac: bytes, expected: bytes, secret: bytes, status_secret: bytes | None,
                   nonce: bytes, signed: bytes, role: int) -> bytes:
    """Which secret the HELLO's MAC proves; the status credential only for STATUS."""
    if hmac.compare_digest(expected, mac):
        return secret
    if status_secret is not None and hmac.compare_digest(
            _mac(status_secret, nonce, signed), mac):
        if role != Role.STATUS:
            raise LinkAuthError("the status credential allows the STATUS role only")
        return status_secret
    raise LinkAuthError("wrong or missing link secret")


def send_ack(conn: FrameSocket, secret: bytes, nonces: tuple[bytes, bytes],
             ack: HelloAck) -> None:
    """Accept an authenticated dialer; the MAC proves this stage knows the secret too."""
    server_nonce, client_nonce = nonces
    endpoint = _name(ack.return_endpoint, "return endpoint")
    stage_id = _name(ack.final_stage_id, "stage id")
    fields = _ACK.pack(b"\0" * 32, ack.num_stages, ack.min_lanes, ack.min_session_tokens,
                       ack.min_batch, len(endpoint), len(stage_id))[32:] + endpoint + stage_id
    mac = _mac(secret, b"ack", client_nonce, server_nonce, fields)
    conn.write(encode_frame(FrameKind.HELLO_ACK, mac + fields))


def send_refuse(conn: FrameSocket, reason: str) -> None:
    """Refuse an authenticated dialer with a reason it will log; never raises."""
    try:
        conn.write(encode_text(FrameKind.REFUSE, reason))
    except OSError:
        pass


# -- dialer side ---------------------------------------------------------------------------


def dial_handshake(conn: FrameSocket, secret: bytes, hello: Hello) -> HelloAck:
    """Answer the listener's challenge and read its verdict.

    Raises:
        LinkRefusedError: The listener refused (its reason is the message).
        LinkAuthError: The listener could not prove it knows the secret.
        LinkProtocolError: The listener is not a compatible skippyd stage.
        OSError: The connection failed or timed out.
    """
    body = _expect(conn.read(), FrameKind.CHALLENGE, "CHALLENGE")
    if len(body) != _CHALLENGE.size:
        raise LinkProtocolError("malformed CHALLENGE")
    magic, version, _reserved, server_nonce = _CHALLENGE.unpack(body)
    if magic != MAGIC or version != PROTOCOL_VERSION:
        raise LinkProtocolError(f"peer is not a skippyd stage speaking link protocol "
                                f"{PROTOCOL_VERSION} (magic {magic!r}, version {version})")
    client_nonce = os.urandom(16)
    model = _name(hello.model_id, "model id")
    unsigned = _HELLO.pack(MAGIC, PROTOCOL_VERSION, int(hello.role), b"\0" * 32, client_nonce,
                           hello.chain_id, hello.n_embd, hello.stage_index, hello.layer_end,
                           len(model)) + model
    signed = unsigned[:8] + unsigned[40:]
    mac = _mac(secret, server_nonce, signed)
    conn.write(encode_frame(FrameKind.HELLO, unsigned[:8] + mac + unsigned[40:]))
    return _read_ack(conn, secret, server_nonce, client_nonce)


def _read_ack(conn: FrameSocket, secret: bytes, server_nonce: bytes,
              client_nonce: bytes) -> HelloAck:
    body = _expect(conn.read(), FrameKind.HELLO_ACK, "HELLO_ACK")
    if len(body) < _ACK.size:
        raise LinkProtocolError("malformed HELLO_ACK")
    mac, num_stages, lanes, ctx, batch, endpoint_len, id_len = _ACK.unpack_from(body)
    if len(body) != _ACK.size + endpoint_len + id_len:
        raise LinkProtocolError("HELLO_ACK length does not match its fields")
    if not hmac.compare_digest(_mac(secret, b"ack", client_nonce, server_nonce, body[32:]),
                               mac):
        raise LinkAuthError("the peer could not prove it knows the link secret")
    endpoint = _utf8(body[_ACK.size:_ACK.size + endpoint_len], "return endpoint")
    stage_id = _utf8(body[_ACK.size + endpoint_len:], "stage id")
    return HelloAck(num_stages, lanes, ctx, batch, endpoint, stage_id)
