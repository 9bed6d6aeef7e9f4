"""Frames on sockets: a whole-frame reader/writer and the batch assembler.

:class:`FrameSocket` validates each header (``wire.decode_header``) before it reads
the body, so an oversized frame is refused without buffering it, and counts the bytes
for the stage's STATUS. :class:`BatchAssembler` groups ITERATION frames into batches.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

from skippyd.engine.runtime.pipeline_types import ChainEntry
from skippyd.link.probe import RoundTrips
from skippyd.link.wire import (
    HANDSHAKE_LIMITS,
    HEADER_BYTES,
    MAX_BATCH_ENTRIES,
    Frame,
    FrameFlag,
    FrameKind,
    LinkLimits,
    LinkProtocolError,
    decode_body,
    decode_header,
    encode_ping,
    encode_pong,
)

if TYPE_CHECKING:
    from skippyd.link.tls import TlsSocket

logger = logging.getLogger(__name__)

#: A body up to this size is read into one buffer at once; a larger one grows with the
#: bytes that actually arrive, so a header's claim alone never allocates much memory.
EAGER_BODY_BYTES = 1 << 20


class FrameSocket:
    """Reads and writes whole frames on a connected socket, counting bytes.

    The socket is a plain TCP one, or a :class:`~skippyd.link.tls.TlsSocket` once TLS
    started on it (``sock`` is replaced then); the bytes counted are the frames'.

    Reading is for one thread; writes are for one thread at a time (callers serialise).

    Two deadlines bound a reader: ``deadline`` (a ``time.monotonic()`` instant, or None)
    ends every read past it, however the bytes trickle in; ``body_timeout_s`` bounds the
    body of each frame once its header arrived, so a peer may be idle between frames
    but cannot stall in the middle of one.
    """

    def __init__(self, sock: socket.socket | TlsSocket,
                 limits: LinkLimits = HANDSHAKE_LIMITS) -> None:
        self.sock = sock
        self.limits = limits
        self.bytes_in = 0
        self.bytes_out = 0
        self.round_trips = RoundTrips()
        """What this end's PINGs measured (``skippyd.link.probe``)."""
        self.last_heard = time.monotonic()
        """When bytes last arrived (``time.monotonic()``): what a silence watch reads."""
        self.deadline: float | None = None
        self.body_timeout_s: float | None = None
        self._header = bytearray(HEADER_BYTES)
        self._write_lock = threading.Lock()

    def read(self) -> Frame | None:
        """The next frame, or None on a clean end of stream between frames.

        Raises:
            LinkProtocolError: Malformed, oversized or truncated frame.
            OSError: The connection failed, or a deadline passed (``TimeoutError``).
        """
        got = self._recv_into(memoryview(self._header), self.deadline)
        if got == 0:
            return None
        if got < HEADER_BYTES:
            raise LinkProtocolError(f"truncated frame header ({got} of {HEADER_BYTES} bytes)")
        header = decode_header(self._header, self.limits)
        body = self._read_body(header.body_bytes)
        if len(body) < header.body_bytes:
            raise LinkProtocolError(f"truncated {header.kind.name} frame "
                                    f"({len(body)} of {header.body_bytes} body bytes)")
        return decode_body(header, body, self.limits.max_context_tokens)

    def _read_body(self, size: int) -> bytearray:
        deadline = self.deadline
        if self.body_timeout_s is not None:
            body_deadline = time.monotonic() + self.body_timeout_s
            deadline = body_deadline if deadline is None else min(deadline, body_deadline)
        body = bytearray(min(size, EAGER_BODY_BYTES))
        filled = self._recv_into(memoryview(body), deadline)
        while filled == len(body) < size:
            # Double what arrived, never past the declared size: memory follows the bytes.
            body.extend(bytes(min(len(body), size - len(body))))
            filled += self._recv_into(memoryview(body)[filled:], deadline)
        del body[filled:]
        return body

    def _recv_into(self, view: memoryview, deadline: float | None = None) -> int:
        """Fill ``view``; returns how many bytes arrived before the stream ended.

        Raises:
            TimeoutError: ``deadline`` passed first.
        """
        done = 0
        restore = self.sock.gettimeout() if deadline is not None else None
        try:
            while done < len(view):
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("read deadline passed")
                    self.sock.settimeout(left if restore is None else min(left, restore))
                n = self.sock.recv_into(view[done:])
                if n == 0:
                    break
                done += n
                self.last_heard = time.monotonic()
        finally:
            self.bytes_in += done
            if deadline is not None:
                self.sock.settimeout(restore)
        return done

    def write(self, data: bytes) -> None:
        """Send whole frames; frames of concurrent writers never interleave."""
        with self._write_lock:
            self.sock.sendall(data)
            self.bytes_out += len(data)

    def send_ping(self, now_ns: int) -> None:
        self.write(encode_ping(now_ns))

    def answer_probe(self, frame: Frame) -> bool:
        """Handle a PING (answer it) or a PONG (record the round trip); True if it was
        one of them, so the caller's reader skips it."""
        if frame.kind is FrameKind.PING:
            self.write(encode_pong(frame.header.request_id))
            return True
        if frame.kind is FrameKind.PONG:
            sent_ns = frame.header.request_id
            self.round_trips.add(max(0, time.monotonic_ns() - sent_ns) / 1e9)
            return True
        return False

    def close(self) -> None:
        """Shut the connection down (unblocking a reader) and close it. Idempotent."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class BatchAssembler:
    """Groups consecutive ITERATION frames of one ``request_id`` into a batch.

    Raises :class:`LinkProtocolError` on a batch that mixes request ids, repeats a
    session or grows beyond :data:`MAX_BATCH_ENTRIES`.
    """

    def __init__(self) -> None:
        self._request_id: int | None = None
        self._entries: list[ChainEntry] = []
        self._sessions: set[int] = set()
        self._half_rows = False

    @property
    def open(self) -> bool:
        return self._request_id is not None

    def add(self, frame: Frame) -> tuple[int, list[ChainEntry], bool] | None:
        """Add an ITERATION frame; when the batch ends, returns its request id, its
        entries, and whether its rows came as float16 (to be forwarded the same way)."""
        header = frame.header
        if self._request_id is not None and header.request_id != self._request_id:
            raise LinkProtocolError(f"ITERATION frame of batch {header.request_id} inside "
                                    f"unfinished batch {self._request_id}")
        if header.session_id in self._sessions:
            raise LinkProtocolError(f"batch {header.request_id} repeats session "
                                    f"{header.session_id}")
        if len(self._entries) >= MAX_BATCH_ENTRIES:
            raise LinkProtocolError(f"batch {header.request_id} exceeds {MAX_BATCH_ENTRIES} "
                                    "entries")
        self._request_id = header.request_id
        self._half_rows = self._half_rows or bool(header.flags & FrameFlag.ROWS_F16)
        self._sessions.add(header.session_id)
        assert isinstance(frame.payload, ChainEntry)
        self._entries.append(frame.payload)
        if not header.flags & FrameFlag.END_OF_BATCH:
            return None
        done = (header.request_id, self._entries, self._half_rows)
        self._request_id, self._entries, self._sessions = None, [], set()
        self._half_rows = False
        return done
