"""Connection-level attacks for robustness benchmarks and tests (your own daemons only).

Each attack runs on a thread of its own over non-blocking sockets and an epoll
selector (so a thousand sockets are no problem), keeps its connections up by reopening
the ones the server closes, and counts what happened:

* :class:`IdleFlood` — connections that never send a byte;
* :class:`Drippers` — connections that send a payload one byte at a time (a request head,
  a request body, a stage-link HELLO), each byte well within any per-read timeout;
* :class:`ProbeLoop` — what a supervisor does: ``GET /health`` every interval, counting
  answers other than 200.

Every attack counts ``cut``: connections the server closed before the payload was done
(for an idle or dripping peer, that is the server's deadline at work).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger(__name__)

#: A request head that is never finished when dripped (40 header lines).
SLOW_HEAD = (b"GET /health HTTP/1.1\r\nHost: victim\r\n"
             + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"z" * 20) for i in range(40)) + b"\r\n")


def slow_body_request(path: str = "/v1/completions", length: int = 4096) -> tuple[bytes, bytes]:
    """A complete head announcing ``length`` body bytes, and the body to drip after it."""
    head = (f"POST {path} HTTP/1.1\r\nHost: victim\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()
    return head, b'{"prompt": "' + b"x" * (length - 14) + b'"}'


@dataclass
class AttackStats:
    """What an attack did so far (read by the caller at any time)."""

    opened: int = 0
    cut: int = 0
    """Connections the server closed before the attacker was done with them."""
    refused: int = 0
    """Connection attempts that failed outright."""
    bytes_sent: int = 0
    lifetimes_s: list[float] = field(default_factory=list)
    """How long each cut connection had lived (the last 1000)."""


class _Attack:
    """``n`` sockets to ``address`` kept open; subclasses decide what they send."""

    def __init__(self, address: tuple[str, int], n: int, name: str,
                 reopen: bool = True) -> None:
        self.address = address
        self.n = n
        self.reopen = reopen
        self.stats = AttackStats()
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._born: dict[socket.socket, float] = {}
        self._owed = 0

    def start(self) -> _Attack:
        for _ in range(self.n):
            self._open()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for sock in list(self._born):
            self._forget(sock)
        self._selector.close()

    def __enter__(self) -> _Attack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def open_now(self) -> int:
        return len(self._born)

    def _open(self) -> None:
        try:
            sock = socket.create_connection(self.address, timeout=5)
        except OSError:
            self.stats.refused += 1
            return
        sock.setblocking(False)
        self._born[sock] = time.monotonic()
        self._selector.register(sock, selectors.EVENT_READ)
        self.stats.opened += 1
        self._opened(sock)

    def _forget(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        self._born.pop(sock, None)
        sock.close()

    def _cut(self, sock: socket.socket) -> None:
        born = self._born.get(sock, time.monotonic())
        self.stats.cut += 1
        self.stats.lifetimes_s = [*self.stats.lifetimes_s[-999:], time.monotonic() - born]
        self._forget(sock)
        if self.reopen:
            self._owed += 1  # reopened on the next tick: a steady attacker, not a busy loop

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            timeout = max(0.0, next_tick - time.monotonic())
            for key, _ in self._selector.select(timeout=timeout):
                self._readable(key.fileobj)  # type: ignore[arg-type]
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self._tick_s()
                owed, self._owed = self._owed, 0
                for _ in range(owed):
                    self._open()
                self._tick()

    def _readable(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # closed by the server (an answer before it, if any, is ignored)
            self._cut(sock)

    def _tick_s(self) -> float:
        return 0.5

    def _tick(self) -> None:
        pass

    def _opened(self, sock: socket.socket) -> None:
        pass


class IdleFlood(_Attack):
    """``n`` connections that never send a byte (reopened when the server closes them)."""

    def __init__(self, address: tuple[str, int], n: int, *, reopen: bool = True) -> None:
        super().__init__(address, n, "attack-idle", reopen)


class Drippers(_Attack):
    """``n`` connections sending ``payload`` one byte per ``every_s`` each."""

    def __init__(self, address: tuple[str, int], n: int, payload: bytes,
                 every_s: float = 1.0, *, prefix: bytes = b"") -> None:
        super().__init__(address, n, "attack-drip")
        self.payload = payload
        self.prefix = prefix
        """Sent whole on connecting (a request head, before a dripped body)."""
        self.every_s = every_s
        self._progress: dict[socket.socket, int] = {}
        self.completed = 0
        """Payloads sent whole: the server let a dripping peer finish."""

    def _opened(self, sock: socket.socket) -> None:
        self._progress[sock] = 0
        if self.prefix:
            try:
                sock.sendall(self.prefix)
            except OSError:
                self._cut(sock)

    def _forget(self, sock: socket.socket) -> None:
        self._progress.pop(sock, None)
        super()._forget(sock)

    def _tick_s(self) -> float:
        return self.every_s

    def _tick(self) -> None:
        for sock, sent in list(self._progress.items()):
            if sent >= len(self.payload):
                self.completed += 1
                self._forget(sock)
                self._open()
                continue
            try:
                sock.send(self.payload[sent:sent + 1])
            except BlockingIOError:
                continue
            except OSError:
                self._cut(sock)
                continue
            self._progress[sock] = sent + 1
            self.stats.bytes_sent += 1


class ProbeLoop:
    """``GET /health`` every ``every_s`` on a fresh connection, like a supervisor."""

    def __init__(self, url: str, every_s: float = 0.5, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/") + "/health"
        self.every_s = every_s
        self.timeout_s = timeout_s
        self.answers: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="attack-probe")

    @property
    def failures(self) -> int:
        """Probes that did not get a 200."""
        return sum(count for answer, count in self.answers.items() if answer != "200")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                answer = str(httpx.get(self.url, timeout=self.timeout_s).status_code)
            except httpx.HTTPError as exc:
                answer = type(exc).__name__
            self.answers[answer] = self.answers.get(answer, 0) + 1
            self._stop.wait(self.every_s)

    def __enter__(self) -> ProbeLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 5)


@contextlib.contextmanager
def running(*attacks: _Attack | ProbeLoop) -> Iterator[None]:
    """Run every attack for the duration of the block."""
    with contextlib.ExitStack() as stack:
        for attack in attacks:
            stack.enter_context(attack)
        yield


def process_figures(pid: int) -> dict[str, int]:
    """Threads, resident memory (KiB) and open file descriptors of a process (Linux)."""
    import os
    from pathlib import Path

    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"threads": int(status["Threads"]), "rss_kib": int(status["VmRSS"].split()[0]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}
