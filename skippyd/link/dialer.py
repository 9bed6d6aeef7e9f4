"""Stage 0's connection to the rest of a split pipeline: dial, authenticate, reconnect.

:class:`ChainLink` dials stage 1 (a CHAIN connection, which every stage extends to the
next one before answering), then dials the final stage's return endpoint (a RETURN
connection) so predictions come straight back to stage 0. A
connector thread keeps the pair up: when either side fails, closed or silent for
``link.silence_timeout_s`` (``skippyd.link.liveness``), it tells the pipeline runtime
(``on_down``), waits with exponential backoff and dials again. Each successful
connection gets a new ``epoch`` so results of a lost connection are never mistaken
for the current one's.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from skippyd.config import StageConfig
from skippyd.config.schema import parse_host_port
from skippyd.engine.runtime.pipeline_types import (
    ChainEntry,
    ChainSample,
    ChainUnavailableError,
    StageTimeline,
)
from skippyd.engine.telemetry_events import ChainDown, ChainUp, TelemetryPayload
from skippyd.link.framing import FrameSocket
from skippyd.link.handshake import Hello, HelloAck, Role, dial_handshake
from skippyd.link.liveness import SILENCE_TIMEOUT_S
from skippyd.link.probe import LinkPinger, link_view
from skippyd.link.tls import LinkTls, dial_tls
from skippyd.link.wire import (
    Frame,
    FrameKind,
    LinkLimits,
    LinkProtocolError,
    encode_drop,
    encode_iteration,
    encode_text,
)

logger = logging.getLogger(__name__)

#: First and longest wait between reconnection attempts.
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
#: The whole handshake, the downstream stages' own dialling included.
CHAIN_SETUP_TIMEOUT_S = 30.0
#: One TCP connect attempt.
DIAL_TIMEOUT_S = 5.0
#: After start, how long stage 0 waits for the next stage quietly: stages started together
#: (by systemd, by a script) come up in any order, so early refusals are not a fault.
STARTUP_GRACE_S = 15.0


class ChainListener(Protocol):
    """Who hears what arrives from the chain (the pipeline runtime)."""

    def on_result(self, epoch: int, request_id: int, samples: Sequence[ChainSample]) -> None: ...

    def on_error(self, epoch: int, request_id: int, message: str) -> None: ...

    def on_down(self, epoch: int, reason: str) -> None: ...


class ChainSetupError(Exception):
    """The chain answered but cannot serve this stage (capacity, topology)."""


@dataclass(frozen=True, slots=True)
class ChainIdentity:
    """What stage 0 tells the chain about itself and requires from it."""

    downstream_id: str
    endpoint: tuple[str, int]
    secret: bytes
    model_id: str
    layer_end: int
    n_embd: int
    lanes: int
    session_tokens: int
    """Most tokens one session holds (one lane's KV stream)."""
    max_batch_tokens: int
    max_frame_bytes: int
    half_rows: bool = False
    """Send activation rows as float16 (``link.activation_dtype = "f16"``)."""
    tls: LinkTls | None = None
    """Run both connections inside TLS (``link.tls``)."""
    silence_timeout_s: float = SILENCE_TIMEOUT_S
    """A connection on which nothing arrives for this long is lost (``link.silence_timeout_s``)."""
    connect_timeout_s: float = CHAIN_SETUP_TIMEOUT_S
    """Longest one dial may take, handshake included (``link.connect_timeout_s``)."""

    @classmethod
    def from_config(cls, config: StageConfig, n_embd: int, lanes: int,
                    session_tokens: int, max_batch_tokens: int,
                    tls: LinkTls | None = None) -> ChainIdentity:
        downstream = config.downstream
        if downstream is None or config.link.secret is None or config.stage.layer_end is None:
            raise ValueError("a split stage 0 needs [downstream], link.secret and layer_end")
        return cls(downstream.stage_id, downstream.address, config.link.secret.encode(),
                   config.stage.model_id, config.stage.layer_end, n_embd, lanes,
                   session_tokens, max_batch_tokens, config.link.max_frame_bytes,
                   config.link.activation_dtype == "f16", tls,
                   config.link.silence_timeout_s, config.link.connect_timeout_s)


#: TCP keepalive: probe after this idle time, then every interval, give up after count.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3


def configure_socket(sock: socket.socket) -> None:
    """No Nagle delay on small decode frames; keepalive finds vanished peers in ~25 s.

    The silence watch (``skippyd.link.liveness``) notices a silent peer much sooner;
    keepalive is the backstop for a connection nobody watches, where the kernel's
    default (2 hours idle) would let a vanished peer hold resources for that long.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
                          ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, option):  # Linux; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def dial(address: tuple[str, int], secret: bytes, hello: Hello,
         timeout_s: float = CHAIN_SETUP_TIMEOUT_S, *, tls: LinkTls | None = None,
         expect_id: str | None = None) -> tuple[FrameSocket, HelloAck]:
    """Connect to a stage's link listener and authenticate; the socket stays blocking.

    Args:
        tls: Start TLS first (``skippyd.link.tls``); the HMAC handshake runs inside it.
        expect_id: With ``tls``: the stage id the listener's certificate must name.

    Raises:
        OSError: Could not connect, or the peer went silent; ``LinkTlsError`` when TLS
            failed (a refused certificate, a peer without TLS).
        LinkProtocolError: The handshake failed (``LinkRefusedError`` carries a reason).
    """
    sock = socket.create_connection(address, timeout=DIAL_TIMEOUT_S)
    try:
        configure_socket(sock)
        sock.settimeout(timeout_s)
        conn = FrameSocket(sock)
        if tls is not None:
            conn.sock = dial_tls(sock, tls, f"the stage at {_show(address)}", expect_id)
        ack = dial_handshake(conn, secret, hello)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return conn, ack


def query_status(address: tuple[str, int], secret: bytes,
                 timeout_s: float = DIAL_TIMEOUT_S, *, tls: LinkTls | None = None,
                 expect_id: str | None = None) -> dict[str, Any]:
    """Read a stage's counters over its link listener (a STATUS connection).

    ``tls``: the stage uses ``link.tls``; any certificate of the pipeline's CA does
    (``expect_id``: the stage's certificate must name that id).

    Raises:
        OSError: Could not connect, or TLS failed.
        LinkProtocolError: The handshake or the reply was malformed.
    """
    conn, _ = dial(address, secret, Hello(Role.STATUS), timeout_s, tls=tls,
                   expect_id=expect_id)
    try:
        conn.sock.settimeout(timeout_s)
        frame = conn.read()
    finally:
        conn.close()
    if frame is None or frame.kind is not FrameKind.STATUS:
        raise LinkProtocolError("the stage sent no STATUS frame")
    try:
        return json.loads(frame.payload)  # type: ignore[arg-type]
    except ValueError as exc:
        raise LinkProtocolError(f"malformed STATUS body: {exc}") from None


class ChainLink:
    """The downstream side of stage 0; see the module docstring.

    Implements ``skippyd.engine.runtime.pipeline.Downstream``.
    """

    def __init__(self, identity: ChainIdentity,
                 publish: Callable[[TelemetryPayload], None] | None = None) -> None:
        self.identity = identity
        self._publish = publish
        """Where the chain's going up and down is told (the stage's telemetry)."""
        self._listener: ChainListener | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self._down = threading.Event()
        self._epoch = 0
        self._up = False
        self._num_stages = 1
        self._final_id = "the final stage"
        self._reason: str | None = "connecting"
        self._last_failure: str | None = None
        self._warned = False
        """This outage's failure was said at warning level already."""
        self._started_at = time.monotonic()
        self._data: FrameSocket | None = None
        self._return: FrameSocket | None = None
        self._bytes = [0, 0]
        self.timeline = StageTimeline()
        """Encode and send seconds of the batches sent (the rest is the pipeline's)."""
        self._pinger: LinkPinger | None = None
        self._thread = threading.Thread(target=self._run, name="skippyd-chain-connector",
                                        daemon=True)

    def start(self, listener: ChainListener) -> None:
        self._listener = listener
        self._started_at = time.monotonic()
        self._pinger = LinkPinger("skippyd-chain-pinger",
                                  silence_timeout_s=self.identity.silence_timeout_s).start()
        self._thread.start()

    def close(self) -> None:
        """Stop reconnecting and close both connections. Idempotent."""
        self._closed.set()
        self._mark_down(self._epoch, "stage 0 is shutting down")
        if self._pinger is not None:
            self._pinger.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=DIAL_TIMEOUT_S + 1)

    # -- Downstream protocol -------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def is_up(self) -> bool:
        return self._up

    @property
    def num_stages(self) -> int:
        return self._num_stages

    def down_reason(self) -> str | None:
        return None if self._up else self._reason

    def send_batch(self, request_id: int, entries: Sequence[ChainEntry]) -> None:
        started = time.perf_counter()
        last = len(entries) - 1
        half = self.identity.half_rows
        data = b"".join(encode_iteration(request_id, entry, end_of_batch=i == last,
                                         half_rows=half)
                        for i, entry in enumerate(entries))
        encoded = time.perf_counter()
        self._write(data)
        self.timeline.encode_s += encoded - started
        self.timeline.send_s += time.perf_counter() - encoded

    def send_drop(self, session_id: int) -> None:
        self._write(encode_drop(session_id))

    def send_error(self, message: str) -> None:
        """Tell the chain that stage 0 failed (an ERROR frame for no batch); never
        raises: the chain may be down already."""
        try:
            self._write(encode_text(FrameKind.ERROR, message, request_id=0))
        except ChainUnavailableError:
            pass

    def reset(self, epoch: int, reason: str) -> None:
        self._mark_down(epoch, reason)

    def _write(self, data: bytes) -> None:
        with self._send_lock:
            conn, epoch = self._data, self._epoch
            if conn is None or not self._up:
                raise ChainUnavailableError(f"the downstream pipeline is unavailable: "
                                            f"{self._reason}")
            try:
                conn.write(data)
            except OSError as exc:
                self._mark_down(epoch, f"sending to {self.identity.downstream_id} failed: {exc}")
                raise ChainUnavailableError(f"the downstream pipeline was lost: {exc}") from exc

    # -- status ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Counters and state for STATUS and benchmarks."""
        with self._lock:
            conns = [c for c in (self._data, self._return) if c is not None]
            bytes_out = self._bytes[0] + sum(c.bytes_out for c in conns)
            bytes_in = self._bytes[1] + sum(c.bytes_in for c in conns)
        return {"up": self._up, "reason": self.down_reason(), "epoch": self._epoch,
                "num_stages": self._num_stages + 1, "bytes_out": bytes_out,
                "bytes_in": bytes_in}

    def links(self) -> list[dict[str, Any]]:
        """Round trips and send queues of the connection to stage 1 and of the return
        connection from the final stage (``skippyd.link.probe``)."""
        with self._lock:
            data, ret = self._data, self._return
        return [link_view(data, self.identity.downstream_id, "downstream"),
                link_view(ret, self._final_id, "return")]

    # -- connector thread ----------------------------------------------------------------

    def _run(self) -> None:
        delay = BACKOFF_MIN_S
        while not self._closed.is_set():
            try:
                self._connect()
            except (OSError, LinkProtocolError, ChainSetupError) as exc:
                self._note_failure(f"{self.identity.downstream_id} at "
                                   f"{_show(self.identity.endpoint)}: {exc}", delay)
                self._closed.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            delay = BACKOFF_MIN_S
            self._down.wait()
            self._closed.wait(BACKOFF_MIN_S)

    def _note_failure(self, reason: str, delay: float) -> None:
        # Each new reason is said once; identical repeats during the backoff are debug. Until
        # the pipeline has first connected, within the start-up grace, it is only info.
        new = reason != self._last_failure
        starting = (self._epoch == 0
                    and time.monotonic() - self._started_at < STARTUP_GRACE_S)
        if starting:
            level = logging.INFO if new else logging.DEBUG
        else:
            level = logging.WARNING if new or not self._warned else logging.DEBUG
            self._warned = True
        logger.log(level, "cannot reach the pipeline: %s (retrying in %.1f s)", reason, delay)
        self._last_failure = reason
        self._reason = f"{reason} (reconnecting)"

    def _connect(self) -> None:
        ident = self.identity
        chain_id = int.from_bytes(os.urandom(8), "little")
        hello = Hello(Role.CHAIN, chain_id, ident.n_embd, 0, ident.layer_end, ident.model_id)
        data, ack = dial(ident.endpoint, ident.secret, hello, ident.connect_timeout_s,
                         tls=ident.tls, expect_id=ident.downstream_id)
        # Stage 1 watches this connection from now on: let it hear from stage 0 while
        # the return connection is dialled.
        self._ping(data)
        try:
            self._check_capacity(ack)
            # The final stage's certificate must name the stage the chain announced.
            ret, _ = dial(parse_host_port(ack.return_endpoint), ident.secret,
                          Hello(Role.RETURN, chain_id, ident.n_embd, 0, ident.layer_end,
                                ident.model_id), ident.connect_timeout_s, tls=ident.tls,
                          expect_id=ack.final_stage_id)
        except BaseException:
            self._forget(data)
            data.close()
            raise
        limits = LinkLimits(max_frame_bytes=ident.max_frame_bytes, row_width=ident.n_embd)
        data.limits = ret.limits = limits
        self._go_up(data, ret, ack)

    def _check_capacity(self, ack: HelloAck) -> None:
        ident = self.identity
        if ack.min_lanes < ident.lanes:
            raise ChainSetupError(f"a later stage has {ack.min_lanes} lanes, fewer than "
                                  f"stage 0's {ident.lanes}")
        if ack.min_session_tokens < ident.session_tokens:
            raise ChainSetupError(
                f"a later stage holds at most {ack.min_session_tokens} tokens per session "
                f"(runtime.ctx_size / lanes), fewer than stage 0's {ident.session_tokens}")
        if ack.min_batch < ident.max_batch_tokens:
            raise ChainSetupError(
                f"a later stage takes at most {ack.min_batch} tokens per batch "
                f"(runtime.n_batch), fewer than stage 0's {ident.max_batch_tokens}: give every "
                "stage the same runtime.n_batch")

    def _go_up(self, data: FrameSocket, ret: FrameSocket, ack: HelloAck) -> None:
        with self._lock:
            if self._closed.is_set():
                for conn in (data, ret):
                    self._forget(conn)
                    conn.close()
                return
            self._last_failure = None
            self._warned = False
            self._epoch += 1
            epoch = self._epoch
            self._data, self._return = data, ret
            self._num_stages = ack.num_stages
            self._final_id = ack.final_stage_id or self._final_id
            self._down.clear()
            self._up = True
            self._reason = None
        if self._pinger is not None:
            # A peer that stops answering (a stopped process, a lost machine) leaves
            # the connections open but silent: end them as if they had closed.
            lose = functools.partial(self._mark_down, epoch)
            self._pinger.watch(data, self.identity.downstream_id, lose)
            self._pinger.watch(ret, self._final_id, lose)
        for target, conn, name in ((self._read_returns, ret, "return"),
                                   (self._watch_data, data, "watch")):
            threading.Thread(target=target, args=(conn, epoch), daemon=True,
                             name=f"skippyd-chain-{name}-{epoch}").start()
        logger.info("pipeline connected: %d stages, predictions return from %s at %s",
                    ack.num_stages + 1, ack.final_stage_id, ack.return_endpoint)
        if self._publish is not None:
            self._publish(ChainUp(epoch, ack.num_stages + 1))

    def _mark_down(self, epoch: int, reason: str) -> None:
        with self._lock:
            if epoch != self._epoch or self._data is None:
                return
            conns = [c for c in (self._data, self._return) if c is not None]
            self._bytes[0] += sum(c.bytes_out for c in conns)
            self._bytes[1] += sum(c.bytes_in for c in conns)
            self._data = self._return = None
            was_up, self._up = self._up, False
            self._reason = f"{reason} (reconnecting)"
        for conn in conns:
            self._forget(conn)
            conn.close()
        if was_up and not self._closed.is_set():
            logger.warning("pipeline lost: %s; reconnecting", reason)
            if self._publish is not None:
                self._publish(ChainDown(epoch, reason))
        if self._listener is not None:
            self._listener.on_down(epoch, reason)
        self._down.set()

    def _ping(self, conn: FrameSocket) -> None:
        if self._pinger is not None:
            self._pinger.add(conn)

    def _forget(self, conn: FrameSocket) -> None:
        if self._pinger is not None:
            self._pinger.remove(conn)

    def _read_returns(self, conn: FrameSocket, epoch: int) -> None:
        """Deliver RESULT and ERROR frames of the return connection until it fails."""
        try:
            while True:
                frame = conn.read()
                if frame is None:
                    reason = f"{self._final_id} closed the return connection"
                    break
                self._deliver(conn, frame, epoch)
        except LinkProtocolError as exc:
            reason = f"protocol error on the return connection: {exc}"
        except OSError as exc:
            reason = f"return connection failed: {exc}"
        self._mark_down(epoch, reason)

    def _deliver(self, conn: FrameSocket, frame: Frame, epoch: int) -> None:
        listener = self._listener
        assert listener is not None
        if conn.answer_probe(frame):
            return
        if frame.kind is FrameKind.RESULT:
            listener.on_result(epoch, frame.header.request_id, frame.payload)  # type: ignore[arg-type]
        elif frame.kind is FrameKind.ERROR:
            listener.on_error(epoch, frame.header.request_id, str(frame.payload))
        else:
            raise LinkProtocolError(f"unexpected {frame.kind.name} frame")

    def _watch_data(self, conn: FrameSocket, epoch: int) -> None:
        """Only probes come back on the data connection: anything else ends it."""
        try:
            while (frame := conn.read()) is not None and conn.answer_probe(frame):
                pass
            reason = (f"{self.identity.downstream_id} closed the connection" if frame is None
                      else f"unexpected {frame.kind.name} frame from "
                           f"{self.identity.downstream_id}")
        except (LinkProtocolError, OSError) as exc:
            reason = f"connection to {self.identity.downstream_id} failed: {exc}"
        self._mark_down(epoch, reason)


def _show(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
