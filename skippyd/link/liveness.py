"""Link liveness: a connection on which nothing arrives for too long is taken for lost.

A closed socket tells at once that a peer is gone, but a peer that stops without closing
(a stopped process, a machine that lost power or its network) leaves the connection
silent: TCP keeps it open, and keepalive probes go unanswered only on a dead machine,
never for a stopped process whose kernel still acknowledges them. Every stage PINGs each
of its connections every second (``skippyd.link.probe``), from a thread of its own, so a
healthy peer is never silent for long, however busy its worker. :class:`SilenceWatch`
checks each watched connection a few times a second and hands one that stayed silent
for ``timeout_s`` to its owner, which ends it as it ends a closed one.

Bytes waiting in the kernel's receive queue count as heard: they show that the peer
sent, while this stage's own reader is held up (a full worker queue, a drop waiting for
a session's iterations), so a busy stage never blames a peer for its own delay.
"""

from __future__ import annotations

import fcntl
import logging
import struct
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skippyd.link.framing import FrameSocket

logger = logging.getLogger(__name__)

#: Default ``link.silence_timeout_s``: nothing from a peer for this long ends the
#: connection. Peers PING every second, so three missed PINGs.
SILENCE_TIMEOUT_S = 3.0
#: Seconds between two checks of every watched connection.
CHECK_INTERVAL_S = 0.25


def unread_bytes(conn: FrameSocket) -> int:
    """Bytes that arrived on ``conn`` and wait in the kernel for its reader (0 if unknown)."""
    try:
        raw = fcntl.ioctl(conn.sock.fileno(), termios.FIONREAD, struct.pack("i", 0))
    except (OSError, ValueError):
        return 0  # closed, or a platform without the ioctl
    return struct.unpack("i", raw)[0]


@dataclass(slots=True)
class _Watched:
    peer: str
    on_silent: Callable[[str], None]
    since: float
    """When the watch began: silence is counted from here at the earliest."""


class SilenceWatch:
    """A thread that hands connections silent for ``timeout_s`` to their owners.

    ``on_silent(reason)`` runs on the watch's thread, once per connection (which is no
    longer watched then); it must end the connection without waiting on the peer.
    """

    def __init__(self, name: str, timeout_s: float = SILENCE_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0 (got {timeout_s})")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._watched: dict[FrameSocket, _Watched] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> SilenceWatch:
        self._thread.start()
        return self

    def watch(self, conn: FrameSocket, peer: str, on_silent: Callable[[str], None]) -> None:
        """Watch ``conn``, whose far end is ``peer`` (as logs and reasons name it)."""
        with self._lock:
            self._watched[conn] = _Watched(peer, on_silent, time.monotonic())

    def forget(self, conn: FrameSocket) -> None:
        with self._lock:
            self._watched.pop(conn, None)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=CHECK_INTERVAL_S + 1)

    def _run(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL_S):
            for reason, on_silent in self._take_silent(time.monotonic()):
                try:
                    on_silent(reason)
                except Exception:  # a bug in one owner must not end the watch of all
                    logger.exception("ending a silent link connection failed")

    def _take_silent(self, now: float) -> list[tuple[str, Callable[[str], None]]]:
        """Stop watching the connections silent for too long; their reasons and owners."""
        silent = []
        with self._lock:
            for conn, watched in list(self._watched.items()):
                heard = max(conn.last_heard, watched.since)
                if now - heard <= self.timeout_s or unread_bytes(conn) > 0:
                    continue
                del self._watched[conn]
                silent.append((f"{watched.peer} sent nothing for {now - heard:.1f} s "
                               "(stopped, or unreachable)", watched.on_silent))
        return silent
