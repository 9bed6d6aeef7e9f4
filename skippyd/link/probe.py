"""Link health: round-trip probes on every stage connection, and what they measured.

Both ends of every CHAIN and RETURN connection send a PING each
:data:`PING_INTERVAL_S`; the peer answers with a PONG as soon as its reader reaches
the PING. The PING carries the sender's clock, so a PONG alone gives the round trip,
and the round trip includes whatever the PING queued behind: frames in the sender's
socket buffer, a reader held up by a full worker queue. A slow stage (not a dead one)
therefore shows as a growing round trip on the links into it, next to its queue
figures, on every stage that touches those links.

Each connection has a pinging thread of its own: a PING that cannot leave (the peer
reads nothing) holds back no other connection's. The same PINGs keep a connection from
looking silent to its peer's :class:`~skippyd.link.liveness.SilenceWatch`, which
:class:`LinkPinger` also runs for the connections its owner asks it to watch.
"""

from __future__ import annotations

import fcntl
import logging
import struct
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from skippyd.link.liveness import SILENCE_TIMEOUT_S, SilenceWatch

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
    """PINGs every added connection each :data:`PING_INTERVAL_S`, from one thread per
    connection, and ends watched connections that stay silent (``silence_timeout_s``)."""

    def __init__(self, name: str, interval_s: float = PING_INTERVAL_S,
                 silence_timeout_s: float = SILENCE_TIMEOUT_S) -> None:
        self._name = name
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._conns: dict[FrameSocket, threading.Event] = {}
        self._count = 0
        self._stop = threading.Event()
        self.silence = SilenceWatch(f"{name}-watch", silence_timeout_s)

    def start(self) -> LinkPinger:
        self.silence.start()
        return self

    def add(self, conn: FrameSocket) -> None:
        """Start PINGing ``conn`` (again adding it changes nothing)."""
        with self._lock:
            if conn in self._conns or self._stop.is_set():
                return
            stop = self._conns[conn] = threading.Event()
            self._count += 1
            name = f"{self._name}-{self._count}"
        threading.Thread(target=self._ping, args=(conn, stop), daemon=True, name=name).start()

    def watch(self, conn: FrameSocket, peer: str, on_silent: Callable[[str], None]) -> None:
        """PING ``conn`` and hand it to ``on_silent`` once ``peer`` stays silent."""
        self.add(conn)
        self.silence.watch(conn, peer, on_silent)

    def remove(self, conn: FrameSocket) -> None:
        """Stop PINGing and watching ``conn``; its thread ends at its next turn."""
        self.silence.forget(conn)
        with self._lock:
            stop = self._conns.pop(conn, None)
        if stop is not None:
            stop.set()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            stops, self._conns = list(self._conns.values()), {}
        for stop in stops:
            stop.set()
        self.silence.close()

    def _ping(self, conn: FrameSocket, stop: threading.Event) -> None:
        while not stop.wait(self._interval_s) and not self._stop.is_set():
            try:
                conn.send_ping(time.monotonic_ns())
            except OSError:
                return  # the connection's reader notices and ends it
