"""The link listener of a stage: authenticate peers, then serve them by role.

On a later stage, a CHAIN connection from the upstream stage carries batches. Each
batch's entries enter this stage's worker as direct iterations: the worker keeps
per-session order, coalesces the steps of concurrent sessions into one native batch and
trims a session that is ahead of the entry's first position. Results are handled
strictly in arrival order: a middle stage forwards its output rows downstream, the final
stage sends predictions straight to stage 0 on the RETURN connection stage 0 opened to
it. Because the next batch is already queued on the worker while the previous one's rows
are being written, a stage computes one chunk while the last one travels on.

Every stage (stage 0 included) also answers STATUS connections with its counters.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from skippyd.engine.runtime.pipeline_types import StageTimeline
from skippyd.link.dialer import CHAIN_SETUP_TIMEOUT_S, configure_socket
from skippyd.link.framing import FrameSocket
from skippyd.link.handshake import (
    HANDSHAKE_TIMEOUT_S,
    Hello,
    HelloAck,
    Role,
    accept_handshake,
    send_ack,
    send_refuse,
)
from skippyd.link.liveness import SILENCE_TIMEOUT_S
from skippyd.link.probe import LinkPinger
from skippyd.link.relay import ChainConnection
from skippyd.link.tls import LinkTls, LinkTlsError, accept_tls
from skippyd.link.wire import (
    FrameKind,
    LinkAuthError,
    LinkProtocolError,
    encode_frame,
)
from skippyd.throttle import ThrottledLog

if TYPE_CHECKING:
    from skippyd.engine.worker.handle import BatchHandle

logger = logging.getLogger(__name__)

#: Connections allowed to be in the handshake at once; beyond it the oldest gives way.
MAX_PENDING_HANDSHAKES = 16
#: Handshakes one peer address may have pending at once; more are closed at once.
MAX_HANDSHAKES_PER_PEER = 4
#: The listener's own traffic counters, as STATUS reports them.
LISTENER_COUNTERS = ("bytes_in", "bytes_out", "batches", "connections", "rejected")

_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True, slots=True)
class StageFacts:
    """What a stage's link needs to know about the stage."""

    stage_id: str
    stage_index: int
    layer_start: int
    layer_end: int
    model_id: str
    n_embd: int
    lanes: int
    session_tokens: int
    max_batch_tokens: int
    is_first: bool
    is_final: bool
    secret: bytes
    max_frame_bytes: int
    status_secret: bytes | None = None
    """The read-only credential (STATUS only), if the stage has one."""
    max_chains: int = 1
    downstream_id: str | None = None
    downstream: tuple[str, int] | None = None
    advertise: str | None = None
    """The return endpoint a final stage announces instead of its listen address."""
    upstream_id: str | None = None
    """The stage whose certificate a CHAIN connection must present (with ``tls``)."""
    tls: LinkTls | None = None
    """Every connection runs inside TLS (``link.tls``)."""
    silence_timeout_s: float = SILENCE_TIMEOUT_S
    """A chain's connection on which nothing arrives for this long ends the chain."""
    connect_timeout_s: float = CHAIN_SETUP_TIMEOUT_S
    """Longest a dial of the next stage may take, handshake included."""


class StageLinkServer:
    """Listens on ``link.listen`` and serves each authenticated connection by role.

    Args:
        facts: The stage's identity and limits.
        worker: The stage's batch worker (None on stage 0: no chain roles).
        status: Returns the stage's counters for STATUS replies.
    """

    def __init__(self, facts: StageFacts, worker: BatchHandle | None,
                 status: Callable[[], dict[str, Any]],
                 timeline: StageTimeline | None = None) -> None:
        self.facts = facts
        self.worker = worker
        self.timeline = timeline or StageTimeline()
        """Where this stage's batches spend their time (its chain connections add to it)."""
        self._status = status
        self.pinger = LinkPinger(f"skippyd-link-pinger-{facts.stage_id}",
                                 silence_timeout_s=facts.silence_timeout_s)
        """PINGs and watches every chain connection of this stage (started with the
        listener)."""
        self._sock: socket.socket | None = None
        self._address: tuple[str, int] | None = None
        self._handshakes = PendingHandshakes(MAX_PENDING_HANDSHAKES, MAX_HANDSHAKES_PER_PEER)
        self._rejections = ThrottledLog(logger)
        self._lock = threading.Lock()
        self._chains: dict[int, ChainConnection] = {}
        self._closed = threading.Event()
        self._totals = dict.fromkeys(LISTENER_COUNTERS, 0)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"skippyd-link-{facts.stage_id}")

    # -- lifecycle -----------------------------------------------------------------------

    def bind(self, listen: tuple[str, int]) -> tuple[str, int]:
        """Bind and listen; returns the bound (host, port).

        Raises:
            OSError: The address is unusable (in use, not local...).
        """
        host, port = listen
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._address = (host, sock.getsockname()[1])
        return self._address

    @property
    def address(self) -> tuple[str, int] | None:
        return self._address

    def start(self) -> None:
        if self._sock is None:
            raise RuntimeError("bind() the link listener before start()")
        self.pinger.start()
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and close every connection. Idempotent."""
        self._closed.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # unblocks accept() on Linux
            except OSError:
                pass
            self._sock.close()
        with self._lock:
            chains = list(self._chains.values())
        for chain in chains:
            chain.close("the stage is shutting down")
        self.pinger.close()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    # -- registry (used by ChainConnection) --------------------------------------------------

    def register(self, chain: ChainConnection) -> bool:
        """Admit a chain connection; False when ``max_chains`` are open."""
        with self._lock:
            if len(self._chains) >= self.facts.max_chains:
                return False
            self._chains[chain.chain_id] = chain
            self._totals["connections"] += 1
            return True

    def unregister(self, chain: ChainConnection, counters: dict[str, int]) -> None:
        with self._lock:
            if self._chains.get(chain.chain_id) is chain:
                del self._chains[chain.chain_id]
            for key, value in counters.items():
                self._totals[key] += value

    def status(self) -> dict[str, Any]:
        """This stage's counters: link traffic plus whatever the stage reports."""
        with self._lock:
            totals = dict(self._totals)
            chains = list(self._chains.values())
        for chain in chains:
            for key, value in chain.counters().items():
                totals[key] += value
        links = [view for chain in chains for view in chain.links()]
        queued = sum(chain.queued_batches for chain in chains)
        return status_body(self.facts, len(chains), totals,
                           {"links": links, "queued_batches": queued, **self._status()})

    # -- accepting ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._closed.is_set():
            try:
                sock, peer = self._sock.accept()
            except OSError:
                if not self._closed.is_set():
                    logger.exception("link listener failed")
                return
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True,
                             name=f"skippyd-link-conn-{_show(peer)}").start()

    def _serve(self, sock: socket.socket, peer: tuple) -> None:
        conn = FrameSocket(sock)
        authenticated = self._authenticate(conn, peer)
        if authenticated is None:
            conn.close()
            return
        hello, nonces, secret = authenticated
        name = _peer_name(conn, peer)
        peer_id = getattr(conn.sock, "peer_id", None)
        if peer_id is not None:  # TLS: the certificate names the peer
            expected = self.facts.upstream_id
            if hello.role is Role.CHAIN and expected is not None and peer_id != expected:
                self.refuse(conn, name, f"a CHAIN connection must come from {expected}, "
                            f"this certificate is {peer_id}'s")
                conn.close()
                return
        try:
            if hello.role is Role.STATUS:
                self._serve_status(conn, nonces, secret)
            elif hello.role is Role.CHAIN:
                self._serve_chain(conn, hello, nonces, name)
            else:
                self._serve_return(conn, hello, nonces, name)
        except OSError as exc:
            logger.info("link connection from %s ended: %s", name, exc)
        finally:
            conn.close()

    def _authenticate(self, conn: FrameSocket, peer: tuple) -> tuple[Hello, tuple, bytes] | None:
        self._handshakes.enter(conn, peer[0])
        failure: tuple[str, str] | None = None
        raw = conn.sock
        assert isinstance(raw, socket.socket)  # as accepted: TLS starts here
        try:
            configure_socket(raw)
            raw.settimeout(HANDSHAKE_TIMEOUT_S)
            # One deadline for the whole handshake: bytes dripped within each read's
            # timeout must not keep an unauthenticated peer here for longer.
            conn.deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
            if self.facts.tls is not None:
                conn.sock = accept_tls(raw, self.facts.tls, conn.deadline)
            hello, server_nonce, client_nonce, secret = accept_handshake(
                conn, self.facts.secret, self.facts.status_secret)
        except LinkTlsError as exc:
            failure = ("tls", f"TLS: {exc}")
        except LinkAuthError as exc:
            failure = ("auth", str(exc))
        except LinkProtocolError as exc:
            failure = ("protocol", f"bad handshake: {exc}")
        except OSError as exc:
            failure = ("io", f"handshake failed: {exc}")
        if self._handshakes.leave(conn):
            failure = ("capacity", "gave way to newer connections (more than "
                       f"{MAX_HANDSHAKES_PER_PEER} from this address or "
                       f"{MAX_PENDING_HANDSHAKES} in all were in the handshake)")
        if failure is not None:
            self.reject(_peer_name(conn, peer), failure[1], kind=failure[0])
            return None
        conn.deadline = None
        return hello, (server_nonce, client_nonce), secret

    def reject(self, peer: str, reason: str, kind: str = "refused") -> None:
        """Log (rate-limited per kind) why a connection is being closed, and count it."""
        self._rejections.warning(kind, "link connection from %s rejected: %s", peer, reason)
        with self._lock:
            self._totals["rejected"] += 1

    def refuse(self, conn: FrameSocket, peer: str, reason: str) -> None:
        """Refuse an authenticated peer: log, count, and tell it why."""
        self.reject(peer, reason)
        send_refuse(conn, reason)

    def _serve_status(self, conn: FrameSocket, nonces: tuple, secret: bytes) -> None:
        send_ack(conn, secret, nonces, HelloAck(final_stage_id=self.facts.stage_id))
        body = json.dumps(self.status(), sort_keys=True).encode()
        conn.write(encode_frame(FrameKind.STATUS, body))

    def _serve_chain(self, conn: FrameSocket, hello: Hello, nonces: tuple, peer: str) -> None:
        if self.facts.is_first or self.worker is None:
            self.refuse(conn, peer, "stage 0 accepts no chain connections")
            return
        chain = ChainConnection(self, conn, hello, nonces, peer)
        chain.run()

    def _serve_return(self, conn: FrameSocket, hello: Hello, nonces: tuple, peer: str) -> None:
        if not self.facts.is_final:
            self.refuse(conn, peer, f"stage {self.facts.stage_id} is not the final stage")
            return
        with self._lock:
            chain = self._chains.get(hello.chain_id)
        if chain is None:
            self.refuse(conn, peer, "no chain connection with that id")
            return
        send_ack(conn, self.facts.secret, nonces, HelloAck(final_stage_id=self.facts.stage_id))
        if not chain.attach_return(conn):
            self.reject(peer, "the chain already has a return connection")
            return
        conn.sock.settimeout(None)
        # Stage 0 sends only probes on this connection: anything else ends it.
        try:
            while (frame := conn.read()) is not None and conn.answer_probe(frame):
                pass
            reason = ("stage 0 closed the return connection" if frame is None
                      else f"unexpected {frame.kind.name} frame on the return connection")
        except (LinkProtocolError, OSError) as exc:
            reason = f"return connection failed: {exc}"
        chain.close(reason)

    def return_endpoint(self, conn: FrameSocket) -> str:
        """Where stage 0 reaches this (final) stage: ``link.advertise`` when set, else
        the listen address, or, for a wildcard listen host, the local address the
        upstream connection arrived on."""
        if self.facts.advertise is not None:
            return self.facts.advertise
        assert self._address is not None
        host, port = self._address
        if host in _WILDCARD_HOSTS:
            host = conn.sock.getsockname()[0]
        return _show((host, port))


class PendingHandshakes:
    """Connections still in the handshake, bounded per peer address and in total.

    A newcomer is never turned away: when its address already holds its share, that
    address's oldest pending handshake is shut down to make room, and when every slot
    is taken, the oldest of all is. A real stage finishes its handshake within
    milliseconds, so the peers that give way are the ones only holding slots (silent,
    or dripping bytes), and a restarted stage 0 gets back in even from a host that
    also runs an attacker.
    """

    def __init__(self, capacity: int, per_peer: int) -> None:
        self._capacity = capacity
        self._per_peer = per_peer
        self._lock = threading.Lock()
        self._pending: dict[FrameSocket, str] = {}  # insertion order: oldest first
        self._evicted: set[FrameSocket] = set()

    def enter(self, conn: FrameSocket, address: str) -> None:
        """Take a slot, shutting the connection that gives way down (its reader fails)."""
        with self._lock:
            mine = [c for c, a in self._pending.items() if a == address]
            victim = None
            if len(mine) >= self._per_peer:
                victim = mine[0]
            elif len(self._pending) >= self._capacity:
                victim = next(iter(self._pending))
            if victim is not None:
                del self._pending[victim]
                self._evicted.add(victim)
            self._pending[conn] = address
        if victim is not None:
            try:
                victim.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def leave(self, conn: FrameSocket) -> bool:
        """Free the slot; True if ``conn`` had been shut down to make room."""
        with self._lock:
            self._pending.pop(conn, None)
            if conn in self._evicted:
                self._evicted.discard(conn)
                return True
            return False

    def __len__(self) -> int:
        return len(self._pending)


def status_body(facts: StageFacts, chains: int, totals: dict[str, int],
                stage: dict[str, Any]) -> dict[str, Any]:
    """A STATUS reply: the stage's identity, its listener's traffic, the stage's counters.

    Shared with the control snapshot, so both views of a stage carry the same keys.

    Args:
        facts: The stage's identity.
        chains: Upstream connections open right now.
        totals: The :data:`LISTENER_COUNTERS` values.
        stage: What the stage reports (``SplitStage.status``).
    """
    return {"stage_id": facts.stage_id, "stage_index": facts.stage_index,
            "layer_start": facts.layer_start, "layer_end": facts.layer_end,
            "is_final": facts.is_final, "tls": facts.tls is not None, "chains": chains,
            **totals, **stage}


def _peer_name(conn: FrameSocket, peer: tuple) -> str:
    """How logs name a peer: its address, and with TLS the stage its certificate names."""
    peer_id = getattr(conn.sock, "peer_id", None)
    return _show(peer) if peer_id is None else f"{peer_id} at {_show(peer)}"


def _show(address: tuple) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
