"""TLS on the stage link: TLS 1.3, both ends authenticated by the pipeline's own CA.

With ``link.tls = true`` every connection of a stage runs inside TLS, and the HMAC
handshake runs inside it unchanged, so a stolen certificate alone opens nothing. A
certificate names a stage id, not a host; a plaintext greeting lets both ends of a
TLS/plaintext mismatch log why. ``docs/stage-protocol.md``, *TLS*, has the rules.

A connection is read by one thread while others write to it (the pinger, a completer),
and OpenSSL forbids concurrent calls on one TLS session, so the session runs over memory
buffers (``ssl.SSLObject``): a lock is held only while bytes are encrypted or decrypted
in memory, never while the socket blocks.
"""

from __future__ import annotations

import datetime
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

from skippyd.config.schema import LinkSection
from skippyd.link.framing import FrameSocket
from skippyd.link.wire import FrameKind, LinkProtocolError, encode_text

if TYPE_CHECKING:
    from cryptography import x509

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: The plaintext greeting of a TLS listener (the text of a REFUSE frame).
TLS_GREETING = ("this stage's link uses TLS (link.tls = true): the dialling stage needs "
                "link.tls and a certificate of the pipeline's CA too")
#: What a TLS dialer tells a plaintext listener.
PLAINTEXT_NOTICE = ("the dialling stage uses TLS (link.tls = true) and this stage does not: "
                    "every stage of a pipeline needs the same link.tls")
GREETING_FRAME = encode_text(FrameKind.REFUSE, TLS_GREETING)
#: Encrypted bytes read from the socket at once.
RECV_BYTES = 256 << 10
#: Plaintext encrypted under one hold of the session lock (the reader waits that long).
SEND_CHUNK_BYTES = 256 << 10
#: How long a dialer that refuses the listener's certificate waits for it to hang up.
REFUSE_LINGER_S = 1.0
#: A certificate this close to its end gets a warning at start.
EXPIRY_WARNING = datetime.timedelta(days=30)
#: OpenSSL's verification results that mean "not signed by this pipeline's CA".
_UNKNOWN_ISSUER_CODES = frozenset({2, 18, 19, 20, 21})
_CERT_EXPIRED, _CERT_NOT_YET_VALID = 10, 9


class LinkTlsError(ConnectionError):
    """TLS failed: a certificate was refused, the peer does not speak TLS, or the
    session broke. The message says which, in the link's own terms."""


class TlsSetupError(ValueError):
    """A ``link.tls_*`` file cannot be used; ``key`` names the config key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


# -- the stage's TLS settings ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The three files of one stage's TLS: the pipeline CA, its certificate and key."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_config(cls, link: LinkSection) -> TlsFiles | None:
        """The files ``link`` names, or None when ``link.tls`` is off."""
        if not link.tls:
            return None
        missing = [k for k in ("tls_ca", "tls_cert", "tls_key") if getattr(link, k) is None]
        if missing:
            raise TlsSetupError(f"link.{missing[0]}", "required when link.tls = true")
        assert link.tls_ca and link.tls_cert and link.tls_key
        return cls(Path(link.tls_ca), Path(link.tls_cert), Path(link.tls_key))


def check_tls_files(files: TlsFiles, stage_id: str,
                    now: datetime.datetime | None = None) -> list[tuple[str, str]]:
    """What is wrong with a stage's TLS files, as ``(config key, message)`` pairs.

    Checks that each file reads and parses, that the CA is a CA and the certificate is
    this stage's (``stage.id``), signed by the CA, within its validity, and that the key
    belongs to it. Warns (log) of a key other users may read and of an end near.
    """
    from skippyd.link import keys  # cryptography: loaded only for stages using TLS

    now = now or datetime.datetime.now(datetime.UTC)
    problems: list[tuple[str, str]] = []
    ca = _read("link.tls_ca", files.ca, keys.read_certificate, problems)
    cert = _read("link.tls_cert", files.cert, keys.read_certificate, problems)
    key = _read("link.tls_key", files.key, keys.read_private_key, problems)
    if ca is not None:
        if not keys.is_ca(ca):
            problems.append(("link.tls_ca", f"{files.ca} is not a CA certificate (it names "
                             f"{keys.stage_id_of(ca)!r}); give the pipeline's ca.crt"))
        else:
            _check_validity("link.tls_ca", ca, "the pipeline CA", now, problems)
    if cert is not None:
        named = keys.stage_id_of(cert)
        if named != stage_id:
            problems.append(("link.tls_cert", f"the certificate is for stage {named!r}, this "
                             f"stage is {stage_id!r} (stage.id)"))
        elif ca is not None and not keys.signed_by(cert, ca):
            problems.append(("link.tls_cert", f"not signed by the CA of link.tls_ca "
                             f"({keys.stage_id_of(ca)}): a certificate of another pipeline?"))
        _check_validity("link.tls_cert", cert, "the certificate", now, problems)
    if cert is not None and key is not None and key.public_key() != cert.public_key():
        problems.append(("link.tls_key", f"{files.key} is not the key of link.tls_cert"))
    if key is not None:
        mode = files.key.stat().st_mode & 0o777
        if mode & 0o077:
            logger.warning("link.tls_key: %s may be read by other users (mode %04o); "
                           "chmod 600 it", files.key, mode)
    return problems


def _read(key: str, path: Path, reader: Callable[[Path], T],
          problems: list[tuple[str, str]]) -> T | None:
    try:
        return reader(path)
    except FileNotFoundError:
        problems.append((key, f"file not found: {path}"))
    except OSError as exc:
        problems.append((key, f"cannot read {path}: {exc.strerror}"))
    except ValueError as exc:
        what = "private key" if key == "link.tls_key" else "certificate"
        problems.append((key, f"{path} is not a PEM {what}: {exc}"))
    return None


def _check_validity(key: str, cert: x509.Certificate, what: str, now: datetime.datetime,
                    problems: list[tuple[str, str]]) -> None:
    end, start = cert.not_valid_after_utc, cert.not_valid_before_utc
    if end <= now:
        problems.append((key, f"{what} expired on {end:%Y-%m-%d %H:%M} UTC: make new "
                              "certificates (skippyd link keygen)"))
    elif start > now:
        problems.append((key, f"{what} is not valid before {start:%Y-%m-%d %H:%M} UTC "
                              "(is this machine's clock right?)"))
    elif end - now < EXPIRY_WARNING:
        logger.warning("%s: %s expires on %s UTC, in %d days", key, what,
                       f"{end:%Y-%m-%d %H:%M}", (end - now).days)


class LinkTls:
    """One stage's TLS contexts: its certificate, trusting only the pipeline CA.

    Args:
        files: The CA, certificate and key.
        stage_id: The id the certificate names (this stage, or a monitoring tool).

    Raises:
        TlsSetupError: A file cannot be used (the message names its key).
    """

    def __init__(self, files: TlsFiles, stage_id: str) -> None:
        self.files = files
        self.stage_id = stage_id
        self.client = self._context(server=False)
        self.server = self._context(server=True)

    @classmethod
    def from_config(cls, link: LinkSection, stage_id: str) -> LinkTls | None:
        """The stage's TLS, or None when ``link.tls`` is off; checks the files first."""
        files = TlsFiles.from_config(link)
        if files is None:
            return None
        problems = check_tls_files(files, stage_id)
        if problems:
            raise TlsSetupError(*problems[0])
        return cls(files, stage_id)

    def _context(self, *, server: bool) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False  # certificates name stages, not hosts
        context.verify_mode = ssl.CERT_REQUIRED
        if server:
            context.num_tickets = 0  # a stage never resumes a session
        try:
            context.load_verify_locations(cafile=str(self.files.ca))
        except (OSError, ssl.SSLError) as exc:
            raise TlsSetupError("link.tls_ca", f"cannot load {self.files.ca}: {exc}") from None
        try:
            context.load_cert_chain(str(self.files.cert), str(self.files.key))
        except (OSError, ssl.SSLError) as exc:
            raise TlsSetupError("link.tls_cert", f"cannot load {self.files.cert} with "
                                f"{self.files.key}: {exc}") from None
        return context


# -- a TLS session over a socket ------------------------------------------------------------


class TlsSocket:
    """A connected TCP socket carrying one TLS session; what ``FrameSocket`` needs of it.

    One thread reads while others write (each write whole, serialised by the caller or
    by ``FrameSocket``). Encrypted records leave in the order the session made them.
    """

    def __init__(self, sock: socket.socket, session: ssl.SSLObject, incoming: ssl.MemoryBIO,
                 outgoing: ssl.MemoryBIO, peer_id: str) -> None:
        self.raw = sock
        self.peer_id = peer_id
        """The stage id the peer's certificate names."""
        self._session = session
        self._in = incoming
        self._out = outgoing
        self._lock = threading.Lock()
        """Held for every call into the session, and only for it."""
        self._send_lock = threading.Lock()
        """Held while encrypted bytes are taken from the session and sent."""
        self._buffer = bytearray(RECV_BYTES)
        self._eof = False

    def recv_into(self, view: memoryview) -> int:
        """Decrypt into ``view``; 0 at the end of the stream. Raises ``OSError``
        (``LinkTlsError`` when the TLS session itself fails)."""
        if not len(view):
            return 0
        while True:
            with self._lock:
                try:
                    got: int | None = _read_into(self._session, view)
                except ssl.SSLWantReadError:
                    got = None
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    got = 0  # close_notify, or the TCP stream ended
                except ssl.SSLError as exc:
                    raise LinkTlsError(describe_tls_error(exc)) from None
                flush = self._out.pending > 0
            if flush:  # the read made TLS output of its own (a key update)
                self._send(b"")
            if got is not None:
                return got
            if self._eof:
                return 0
            n = self.raw.recv_into(self._buffer)
            with self._lock:
                if n == 0:
                    self._eof = True
                    self._in.write_eof()
                else:
                    self._in.write(memoryview(self._buffer)[:n])

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        self._send(data)

    def _send(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        with self._send_lock:
            offset = 0
            while True:
                with self._lock:
                    if offset < len(view):
                        chunk = view[offset:offset + SEND_CHUNK_BYTES]
                        try:
                            offset += self._session.write(chunk)
                        except ssl.SSLError as exc:
                            raise LinkTlsError(describe_tls_error(exc)) from None
                    records = self._out.read()
                if records:
                    self.raw.sendall(records)
                if offset >= len(view) and not self._out.pending:
                    return

    def settimeout(self, value: float | None) -> None:
        self.raw.settimeout(value)

    def gettimeout(self) -> float | None:
        return self.raw.gettimeout()

    def shutdown(self, how: int) -> None:
        """Shut the TCP connection down (no close_notify: a writer may be blocked)."""
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()

    def fileno(self) -> int:
        return self.raw.fileno()

    def getsockname(self):
        return self.raw.getsockname()

    def getpeername(self):
        return self.raw.getpeername()


def dial_tls(sock: socket.socket, tls: LinkTls, peer: str,
             expect_id: str | None = None) -> TlsSocket:
    """Start TLS as the dialer on a connected socket; its timeout bounds every read.

    Args:
        sock: Connected to a stage's link listener, nothing read yet.
        tls: This stage's TLS.
        peer: The listener, for messages (``stage-1 at 10.0.0.2:9102``).
        expect_id: The stage id the listener's certificate must name (None: any stage
            of the pipeline).

    Raises:
        LinkTlsError: The listener does not use TLS, a certificate was refused, or the
            listener's certificate names another stage.
        LinkProtocolError: The listener is no skippyd stage.
        OSError: The connection failed or timed out.
    """
    greeting = FrameSocket(sock).read()
    if greeting is None:
        raise LinkTlsError(f"{peer} closed the connection before its TLS greeting")
    if greeting.kind is FrameKind.CHALLENGE:
        try:
            sock.sendall(encode_text(FrameKind.REFUSE, PLAINTEXT_NOTICE))
        except OSError:
            pass
        raise LinkTlsError(f"{peer} does not use TLS on its link (link.tls is off there); "
                           "every stage of a pipeline needs the same link.tls")
    if greeting.kind is not FrameKind.REFUSE or greeting.payload != TLS_GREETING:
        raise LinkProtocolError(f"expected the TLS greeting, got a {greeting.kind.name} frame")
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    session = tls.client.wrap_bio(incoming, outgoing, server_side=False)
    _handshake(sock, session, incoming, outgoing, None)
    tls_sock = TlsSocket(sock, session, incoming, outgoing, _peer_id(session))
    if expect_id is not None and tls_sock.peer_id != expect_id:
        _refuse(tls_sock, f"the dialling stage expected the certificate of {expect_id}, "
                          f"this stage presented {tls_sock.peer_id}'s")
        raise LinkTlsError(f"{peer} presented the certificate of stage "
                           f"{tls_sock.peer_id!r}, expected {expect_id!r}")
    return tls_sock


def _refuse(tls_sock: TlsSocket, reason: str) -> None:
    """Tell the listener why this dialer leaves, and wait (briefly) until it has read
    it: closing with its CHALLENGE unread would reset the connection, reason unread."""
    try:
        tls_sock.sendall(encode_text(FrameKind.REFUSE, reason))
        tls_sock.shutdown(socket.SHUT_WR)
        tls_sock.raw.settimeout(REFUSE_LINGER_S)
        while tls_sock.raw.recv(RECV_BYTES):
            pass
    except OSError:
        pass


def accept_tls(sock: socket.socket, tls: LinkTls, deadline: float | None) -> TlsSocket:
    """Greet a new connection and run the TLS handshake as the server.

    Args:
        deadline: ``time.monotonic()`` by which the handshake must be done.

    Raises:
        LinkTlsError: The peer does not speak TLS or its certificate was refused.
        OSError: The connection failed, or the deadline passed (``TimeoutError``).
    """
    sock.sendall(GREETING_FRAME)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    session = tls.server.wrap_bio(incoming, outgoing, server_side=True)
    _handshake(sock, session, incoming, outgoing, deadline)
    return TlsSocket(sock, session, incoming, outgoing, _peer_id(session))


def _handshake(sock: socket.socket, session: ssl.SSLObject, incoming: ssl.MemoryBIO,
               outgoing: ssl.MemoryBIO, deadline: float | None) -> None:
    """Drive the TLS handshake over ``sock``; an alert this end raises is sent first."""
    restore = sock.gettimeout()
    received = 0
    try:
        while True:
            failure: ssl.SSLError | None = None
            done = False
            try:
                session.do_handshake()
                done = True
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as exc:
                failure = exc
            if outgoing.pending:
                try:
                    sock.sendall(outgoing.read())
                except OSError:
                    if failure is None:
                        raise
            if failure is not None:
                raise LinkTlsError(describe_tls_error(failure)) from None
            if done:
                return
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the TLS handshake took too long")
                sock.settimeout(left if restore is None else min(left, restore))
            data = sock.recv(RECV_BYTES)
            if not data:
                raise LinkTlsError(
                    "the peer closed the connection during the TLS handshake" if received
                    else "the peer left without starting TLS (a stage without link.tls?)")
            received += len(data)
            incoming.write(data)
    finally:
        sock.settimeout(restore)


def _read_into(session: ssl.SSLObject, view: memoryview) -> int:
    # Given a buffer, SSLObject.read returns the count (the type stubs say bytes).
    return cast(int, session.read(len(view), view))


def _peer_id(session: ssl.SSLObject) -> str:
    """The stage id of the peer's (verified) certificate: its subject's common name."""
    cert = session.getpeercert() or {}
    subject = cast(tuple[tuple[tuple[str, str], ...], ...], cert.get("subject", ()))
    for rdn in subject:
        for name, value in rdn:
            if name == "commonName":
                return value
    raise LinkTlsError("the peer's certificate names no stage (no common name)")


def describe_tls_error(exc: ssl.SSLError) -> str:
    """What a TLS failure means for a stage link, in a sentence."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = exc.verify_code
        if code == _CERT_EXPIRED:
            return "the peer's certificate has expired"
        if code == _CERT_NOT_YET_VALID:
            return "the peer's certificate is not valid yet (are the clocks right?)"
        if code in _UNKNOWN_ISSUER_CODES:
            return ("the peer's certificate is not signed by this pipeline's CA "
                    "(link.tls_ca): a stage of another pipeline?")
        return f"the peer's certificate was refused: {exc.verify_message}"
    reason = exc.reason or ""
    refused_ours = {
        "SSLV3_ALERT_CERTIFICATE_EXPIRED": "it has expired",
        "TLSV1_ALERT_UNKNOWN_CA": "it is not signed by the peer's CA (another pipeline's?)",
        "SSLV3_ALERT_BAD_CERTIFICATE": "a bad certificate",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "an unknown certificate",
        "TLSV1_ALERT_DECRYPT_ERROR": "its signature does not verify",
    }
    if reason in refused_ours:
        return f"the peer refused this stage's certificate: {refused_ours[reason]}"
    if reason in ("PEER_DID_NOT_RETURN_A_CERTIFICATE", "TLSV13_ALERT_CERTIFICATE_REQUIRED"):
        side = "the peer" if reason.startswith("PEER") else "this stage"
        return f"{side} presented no certificate; every stage of a TLS pipeline needs one"
    if reason in ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "RECORD_LAYER_FAILURE",
                  "PACKET_LENGTH_TOO_LONG", "UNEXPECTED_RECORD"):
        return f"the peer does not speak TLS ({reason.lower()})"
    if reason in ("UNSUPPORTED_PROTOCOL", "TLSV1_ALERT_PROTOCOL_VERSION"):
        return "the peer does not speak TLS 1.3"
    return f"TLS failed: {reason.lower() or exc}"
