"""A userspace link shaper: a TCP proxy that adds one-way delay and a bandwidth cap.

Split serving on one machine runs over loopback, where a link costs nothing. To see
what a real network does to a pipeline, put a shaper between two stages: it accepts
connections, dials the target, and forwards each direction with a fixed one-way delay
(half the round-trip time) after serialising the bytes at the configured rate, the
way a link of that latency and bandwidth would. No root, no ``tc``.

    python -m skippyd.bench.shaper --listen 127.0.0.1:9202 --target 127.0.0.1:9102 \\
        --rtt-ms 5 --rate-mbit 100

Every connection through one shaper shares its two directions' bandwidth. The shaper
buffers at most :data:`MAX_BUFFERED_BYTES` per connection and direction, beyond which
it stops reading, so back-pressure still reaches the sender.
"""

from __future__ import annotations

import argparse
import collections
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: Bytes one direction of one connection may hold in flight inside the shaper.
MAX_BUFFERED_BYTES = 8 << 20
_CHUNK_BYTES = 64 << 10
READY_LINE = "skippyd link shaper on"


@dataclass(frozen=True, slots=True)
class LinkShape:
    """What the shaped link adds: a one-way delay and a bandwidth cap."""

    rtt_s: float = 0.0
    """Round-trip time; each direction is delayed by half of it."""
    rate_bits_per_s: float | None = None
    """Bandwidth of each direction; None is unlimited."""

    def __post_init__(self) -> None:
        if self.rtt_s < 0:
            raise ValueError(f"rtt_s: must be >= 0 (got {self.rtt_s})")
        if self.rate_bits_per_s is not None and self.rate_bits_per_s <= 0:
            raise ValueError(f"rate_bits_per_s: must be > 0 (got {self.rate_bits_per_s})")

    @property
    def delay_s(self) -> float:
        return self.rtt_s / 2

    def describe(self) -> str:
        rate = ("unlimited" if self.rate_bits_per_s is None
                else f"{self.rate_bits_per_s / 1e6:g} Mbit/s")
        return f"RTT {self.rtt_s * 1000:g} ms, {rate}"


class _Wire:
    """One direction of the shaped link: when its next byte can leave."""

    def __init__(self, shape: LinkShape) -> None:
        self._shape = shape
        self._lock = threading.Lock()
        self._free_at = 0.0

    def release_time(self, nbytes: int, now: float) -> float:
        """When ``nbytes`` that arrived at ``now`` reach the far end."""
        rate = self._shape.rate_bits_per_s
        with self._lock:
            start = max(now, self._free_at)
            self._free_at = start + (0.0 if rate is None else nbytes * 8 / rate)
            return self._free_at + self._shape.delay_s


class _Pipe:
    """Forwards ``source`` to ``sink`` through ``wire``: a reader and a writer thread."""

    def __init__(self, source: socket.socket, sink: socket.socket, wire: _Wire,
                 on_end: Callable[[], None], on_eof: Callable[[], None]) -> None:
        self._source, self._sink, self._wire = source, sink, wire
        self._on_end = on_end
        self._on_eof = on_eof
        self._queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self._cond = threading.Condition()
        self._buffered = 0
        self._stopped = False

    def start(self, name: str) -> None:
        for target in (self._read, self._write):
            threading.Thread(target=target, daemon=True, name=name).start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _read(self) -> None:
        try:
            while True:
                data = self._source.recv(_CHUNK_BYTES)
                release = self._wire.release_time(len(data), time.monotonic()) if data else 0.0
                with self._cond:
                    while self._buffered >= MAX_BUFFERED_BYTES and not self._stopped:
                        self._cond.wait()
                    if self._stopped:
                        return
                    self._queue.append((release, data or None))
                    self._buffered += len(data)
                    self._cond.notify_all()
                if not data:
                    return
        except OSError:
            self._on_end()

    def _write(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._stopped:
                        self._cond.wait()
                    if self._stopped:
                        return
                    release, data = self._queue[0]
                delay = release - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                if data is None:  # the source closed: pass the end of stream on
                    self._sink.shutdown(socket.SHUT_WR)
                    self._on_eof()
                    return
                self._sink.sendall(data)
                with self._cond:
                    self._queue.popleft()
                    self._buffered -= len(data)
                    self._cond.notify_all()
        except OSError:
            self._on_end()


class LinkShaper:
    """Accepts on ``listen`` and forwards every connection to ``target``, shaped.

    Args:
        target: Where connections go (a stage's ``link.listen``).
        shape: Delay and bandwidth to add.
        listen: Where to accept; port 0 picks a free one (see :attr:`address`).
    """

    def __init__(self, target: tuple[str, int], shape: LinkShape,
                 listen: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.target = target
        self.shape = shape
        self._wires = (_Wire(shape), _Wire(shape))  # towards the target, and back
        self._sock = socket.create_server(listen)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self.num_connections = 0
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name="skippyd-shaper")

    def start(self) -> LinkShaper:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting and cut every connection. Idempotent."""
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            _close(sock)
        self._thread.join(timeout=5)

    def __enter__(self) -> LinkShaper:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError as exc:
                logger.warning("shaper cannot reach %s:%d: %s", *self.target, exc)
                _close(client)
                continue
            self._connect(client, upstream)

    def _connect(self, client: socket.socket, server: socket.socket) -> None:
        for sock in (client, server):
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._sockets.update((client, server))
            self.num_connections += 1
        pipes: list[_Pipe] = []
        ended = [0]

        def eof() -> None:  # both directions ended cleanly: the connection is done
            with self._lock:
                ended[0] += 1
                done = ended[0] == 2
            if done:
                end()

        def end() -> None:
            for pipe in pipes:
                pipe.stop()
            for sock in (client, server):
                _close(sock)
            with self._lock:
                self._sockets.difference_update((client, server))

        pipes += [_Pipe(client, server, self._wires[0], end, eof),
                  _Pipe(server, client, self._wires[1], end, eof)]
        for pipe in pipes:
            pipe.start(f"skippyd-shaper-{self.num_connections}")


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected host:port, got {text!r}")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_address, default=("127.0.0.1", 0))
    parser.add_argument("--target", type=_address, required=True)
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip time to add")
    parser.add_argument("--rate-mbit", type=float, default=None,
                        help="bandwidth of each direction, Mbit/s (default: unlimited)")
    args = parser.parse_args(argv)
    try:
        shape = LinkShape(args.rtt_ms / 1000.0,
                          None if args.rate_mbit is None else args.rate_mbit * 1e6)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.WARNING)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with LinkShaper(args.target, shape, args.listen) as shaper:
        host, port = shaper.address
        print(f"{READY_LINE} {host}:{port} -> {args.target[0]}:{args.target[1]} "
              f"({shape.describe()})", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
