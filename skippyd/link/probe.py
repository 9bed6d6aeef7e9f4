"""Link health: round-trip probes on every stage connection, and what they measured.

Both ends of every CHAIN and RETURN connection send a PING each
:data:`PING_INTERVAL_S`; the peer answers with a PONG as soon as its reader reaches
the PING. The PING carries the sender's clock, so a PONG alone gives the round trip,
and the round trip includes whatever the PING queued behind: frames in the sender's
socket buffer, a reader held up by a full worker queue. A slow stage (not a dead one)
therefore shows as a growing round trip on the links into it, next to its queue
figures, on every stage that touches those links.
"""

from __future__ import annotations

import fcntl
import logging
import struct
import termios
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skippyd.link.framing import FrameSocket

logger = logging.getLogger(__name__)

#: Seconds between two PINGs on one connection.
PING_INTERVAL_S = 1.0
#: Round trips kept for the maximum.
RTT_WINDOW = 16
_EWMA_WEIGHT = 0.2


class RoundTrips:
    """Round trips measured on one connection: last, moving average, recent maximum."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=RTT_WINDOW)
        self._avg_s: float | None = None
        self.num_samples = 0

    def add(self, rtt_s: float) -> None:
        with self._lock:
            self._recent.append(rtt_s)
            self._avg_s = rtt_s if self._avg_s is None else (
                (1 - _EWMA_WEIGHT) * self._avg_s + _EWMA_WEIGHT * rtt_s)
            self.num_samples += 1

    def as_dict(self) -> dict[str, float | int | None]:
        """``rtt_ms`` (last), ``rtt_avg_ms``, ``rtt_max_ms`` (of the last few), ``pings``."""
        with self._lock:
            last = self._recent[-1] if self._recent else None
            return {"rtt_ms": None if last is None else last * 1000.0,
                    "rtt_avg_ms": None if self._avg_s is None else self._avg_s * 1000.0,
                    "rtt_max_ms": max(self._recent) * 1000.0 if self._recent else None,
                    "pings": self.num_samples}


def unsent_bytes(conn: FrameSocket) -> int:
    """Bytes written to ``conn`` that the peer has not acknowledged yet (0 if unknown).

    A send queue that stays full means the link or the peer's reader is the bottleneck.
    """
    try:
        raw = fcntl.ioctl(conn.sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    except (OSError, ValueError):
        return 0  # closed, or a platform without the ioctl
    return struct.unpack("i", raw)[0]


def link_view(conn: FrameSocket | None, peer: str, role: str) -> dict[str, Any]:
    """What STATUS and the snapshot say about one connection."""
    view: dict[str, Any] = {"peer": peer, "role": role, "up": conn is not None}
    if conn is None:
        view.update(rtt_ms=None, rtt_avg_ms=None, rtt_max_ms=None, pings=0,
                    send_queue_bytes=0)
        return view
    view.update(conn.round_trips.as_dict())
    view["send_queue_bytes"] = unsent_bytes(conn)
    return view


class LinkPinger:
    """A thread that PINGs every registered connection each :data:`PING_INTERVAL_S`."""

    def __init__(self, name: str, interval_s: float = PING_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._conns: set[FrameSocket] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> LinkPinger:
        self._thread.start()
        return self

    def add(self, conn: FrameSocket) -> None:
        with self._lock:
            self._conns.add(conn)

    def remove(self, conn: FrameSocket) -> None:
        with self._lock:
            self._conns.discard(conn)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._interval_s + 1)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            with self._lock:
                conns = list(self._conns)
            for conn in conns:
                try:
                    conn.send_ping(time.monotonic_ns())
                except OSError:
                    pass  # the connection's reader notices and ends it
