"""TLS on a real link listener: who gets in, who is refused, and what each end says.

A stage-0 listener (no worker: it answers STATUS only) with ``link.tls`` on a loopback
port, keys made by ``skippyd.link.keys``; the peers are real dialers (``query_status``,
``dial``) with certificates of this pipeline, of another one, expired ones, or none.
"""

from __future__ import annotations

import datetime
import logging
import socket
import ssl
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from link_support import wait_until

from skippyd.link import listener as listener_module
from skippyd.link.dialer import dial, query_status
from skippyd.link.framing import FrameSocket
from skippyd.link.handshake import Hello, Role
from skippyd.link.keys import (
    cert_pem,
    issue_stage_cert,
    key_pem,
    read_certificate,
    read_private_key,
    write_pipeline_keys,
)
from skippyd.link.listener import StageFacts, StageLinkServer
from skippyd.link.tls import LinkTls, LinkTlsError, TlsFiles, accept_tls, dial_tls
from skippyd.link.wire import (
    FrameKind,
    LinkLimits,
    LinkProtocolError,
    LinkRefusedError,
    encode_frame,
)

SECRET = b"tls-listener-test-secret-0123456789"
LOGGER = "skippyd.link.listener"


def _tls(directory: Path, stage_id: str) -> LinkTls:
    return LinkTls(TlsFiles(directory / "ca.crt", directory / f"{stage_id}.crt",
                            directory / f"{stage_id}.key"), stage_id)


@pytest.fixture(scope="module")
def pipeline_keys(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pipeline") / "keys"
    write_pipeline_keys(directory, ["s0", "s1", "s2"])
    return directory


@pytest.fixture(scope="module")
def other_keys(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("other") / "keys"
    write_pipeline_keys(directory, ["s0", "s1"])
    return directory


def _expired(directory: Path, stage_id: str) -> LinkTls:
    """A certificate of the pipeline's CA for ``stage_id`` that ended yesterday."""
    ca, ca_key = read_certificate(directory / "ca.crt"), read_private_key(directory / "ca.key")
    now = datetime.datetime.now(datetime.UTC)
    cert, key = issue_stage_cert(ca, ca_key, stage_id, not_before=now - datetime.timedelta(30),
                                 not_after=now - datetime.timedelta(1))
    out = directory.parent / f"expired-{stage_id}"
    out.mkdir(exist_ok=True)
    (out / "cert.pem").write_bytes(cert_pem(cert))
    (out / "key.pem").write_bytes(key_pem(key))
    return LinkTls(TlsFiles(directory / "ca.crt", out / "cert.pem", out / "key.pem"), stage_id)


def _facts(tls: LinkTls | None, **changes) -> StageFacts:
    facts = StageFacts(stage_id="s0", stage_index=0, layer_start=0, layer_end=2,
                       model_id="m", n_embd=8, lanes=2, session_tokens=64,
                       max_batch_tokens=64, is_first=True, is_final=False, secret=SECRET,
                       max_frame_bytes=1 << 20, tls=tls)
    return replace(facts, **changes)


def _serve(facts: StageFacts):
    link = StageLinkServer(facts, None, status=lambda: {"probe": 1})
    address = link.bind(("127.0.0.1", 0))
    link.start()
    return link, address


@pytest.fixture
def server(monkeypatch, pipeline_keys):
    monkeypatch.setattr(listener_module, "HANDSHAKE_TIMEOUT_S", 2.0)
    link, address = _serve(_facts(_tls(pipeline_keys, "s0")))
    yield link, address
    link.close()


def _rejections(caplog, link: StageLinkServer, count: int = 1) -> list[str]:
    """The listener's rejection log lines, once it counted ``count`` rejections (it logs
    each before counting it; the dialer may have given up before that)."""
    wait_until(lambda: link.status()["rejected"] >= count, 10, "the listener's refusal")
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and "rejected" in r.getMessage()]


def _unchanged(link: StageLinkServer, address, pipeline_keys, rejected: int) -> None:
    """The listener still answers an honest peer, and a refusal left nothing behind."""
    status = query_status(address, SECRET, tls=_tls(pipeline_keys, "s1"), expect_id="s0")
    assert status["probe"] == 1 and status["tls"] is True
    assert status["chains"] == 0 and status["connections"] == 0
    assert status["rejected"] == rejected


def test_a_peer_with_a_certificate_of_the_pipeline_reads_status_inside_tls(server,
                                                                        pipeline_keys):
    link, address = server
    _unchanged(link, address, pipeline_keys, rejected=0)


def test_a_plaintext_peer_is_refused_and_told_why(server, pipeline_keys, caplog):
    link, address = server
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(LinkRefusedError, match=r"this stage's link uses TLS"):
            query_status(address, SECRET)
    (line,) = _rejections(caplog, link)
    assert line.startswith("link connection from 127.0.0.1:")
    assert "TLS: the peer left without starting TLS (a stage without link.tls?)" in line
    _unchanged(link, address, pipeline_keys, rejected=1)


def test_plaintext_bytes_instead_of_a_tls_handshake_are_refused(server, pipeline_keys, caplog):
    link, address = server
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with socket.create_connection(address) as sock:
            sock.settimeout(10)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            while sock.recv(4096):
                pass  # the greeting, then the end: the listener closed the connection
    (line,) = _rejections(caplog, link)
    assert "TLS: the peer does not speak TLS" in line
    _unchanged(link, address, pipeline_keys, rejected=1)


def test_a_tls_dialer_tells_a_plaintext_listener_why_it_leaves(pipeline_keys, caplog):
    link, address = _serve(_facts(None))
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            with pytest.raises(LinkTlsError, match=r"does not use TLS on its link"):
                query_status(address, SECRET, tls=_tls(pipeline_keys, "s1"))
            (line,) = _rejections(caplog, link)
        assert "the dialling stage uses TLS (link.tls = true) and this stage does not" in line
        assert query_status(address, SECRET)["rejected"] == 1
    finally:
        link.close()


def test_a_peer_without_a_certificate_is_refused(server, pipeline_keys, caplog):
    link, address = server
    anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anonymous.check_hostname = False
    anonymous.load_verify_locations(cafile=str(pipeline_keys / "ca.crt"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(LinkTlsError, match="this stage presented no certificate"):
            query_status(address, SECRET, tls=SimpleNamespace(client=anonymous))  # type: ignore[arg-type]
    (line,) = _rejections(caplog, link)
    assert "TLS: the peer presented no certificate" in line
    _unchanged(link, address, pipeline_keys, rejected=1)


def test_a_certificate_of_another_pipeline_is_refused_by_the_listener(server, pipeline_keys,
                                                                       other_keys, caplog):
    link, address = server
    # It trusts this pipeline's CA, so it does not refuse the listener first.
    stranger = LinkTls(TlsFiles(pipeline_keys / "ca.crt", other_keys / "s1.crt",
                                other_keys / "s1.key"), "s1")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(LinkTlsError, match="refused this stage's certificate: it is not "
                                               "signed by the peer's CA"):
            query_status(address, SECRET, tls=stranger)
    (line,) = _rejections(caplog, link)
    assert "TLS: the peer's certificate is not signed by this pipeline's CA" in line
    _unchanged(link, address, pipeline_keys, rejected=1)


def test_a_dialer_refuses_a_listener_of_another_pipeline(pipeline_keys, other_keys, caplog):
    link, address = _serve(_facts(_tls(other_keys, "s0")))
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            with pytest.raises(LinkTlsError, match="not signed by this pipeline's CA"):
                query_status(address, SECRET, tls=_tls(pipeline_keys, "s1"))
            (line,) = _rejections(caplog, link)
        assert "TLS: the peer refused this stage's certificate: it is not signed" in line
    finally:
        link.close()


def test_an_expired_certificate_is_refused_with_a_clear_error(server, pipeline_keys, caplog):
    link, address = server
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(LinkTlsError, match="refused this stage's certificate: it has "
                                               "expired"):
            query_status(address, SECRET, tls=_expired(pipeline_keys, "s1"))
    (line,) = _rejections(caplog, link)
    assert "TLS: the peer's certificate has expired" in line
    _unchanged(link, address, pipeline_keys, rejected=1)


def test_a_listener_with_an_expired_certificate_is_refused_by_its_dialer(pipeline_keys,
                                                                        caplog):
    link, address = _serve(_facts(_expired(pipeline_keys, "s0")))
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            with pytest.raises(LinkTlsError, match="the peer's certificate has expired"):
                query_status(address, SECRET, tls=_tls(pipeline_keys, "s1"))
            (line,) = _rejections(caplog, link)
        assert "TLS: the peer refused this stage's certificate: it has expired" in line
    finally:
        link.close()


def test_a_dialer_refuses_a_listener_whose_certificate_names_another_stage(server,
                                                                         pipeline_keys,
                                                                         caplog):
    link, address = server
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(LinkTlsError, match="presented the certificate of stage 's0', "
                                               "expected 's2'"):
            query_status(address, SECRET, tls=_tls(pipeline_keys, "s1"), expect_id="s2")
        (line,) = _rejections(caplog, link)
    assert "refused: the dialling stage expected the certificate of s2, this stage " \
           "presented s0's" in line


def test_a_chain_connection_must_come_from_the_upstream_stage(monkeypatch, pipeline_keys,
                                                              caplog):
    monkeypatch.setattr(listener_module, "HANDSHAKE_TIMEOUT_S", 2.0)
    facts = _facts(_tls(pipeline_keys, "s1"), stage_id="s1", stage_index=1, layer_start=2,
                   layer_end=4, is_first=False, upstream_id="s0")
    link, address = _serve(facts)
    try:
        hello = Hello(Role.CHAIN, 1, 8, 0, 2, "m")
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            with pytest.raises(LinkRefusedError, match="must come from s0, this certificate "
                                                       "is s2's"):
                dial(address, SECRET, hello, tls=_tls(pipeline_keys, "s2"), expect_id="s1")
        (line,) = _rejections(caplog, link)
        assert line.startswith("link connection from s2 at 127.0.0.1:")
    finally:
        link.close()


def test_the_link_secret_is_still_required_inside_tls(server, pipeline_keys, caplog):
    link, address = server
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(LinkProtocolError):
            query_status(address, b"not-the-secret-but-a-valid-certificate",
                         tls=_tls(pipeline_keys, "s1"))
    (line,) = _rejections(caplog, link)
    assert line.startswith("link connection from s1 at 127.0.0.1:")  # its certificate's
    assert "wrong or missing link secret" in line
    _unchanged(link, address, pipeline_keys, rejected=1)


def test_frames_written_by_several_threads_arrive_whole_and_in_order(pipeline_keys):
    """A reader and two writers on each end at once, as on a stage connection (reader,
    completer, pinger): OpenSSL must never see two calls on one session at once."""
    left, right = socket.socketpair()
    accepted: list = []
    acceptor = threading.Thread(
        target=lambda: accepted.append(accept_tls(right, _tls(pipeline_keys, "s0"), None)))
    acceptor.start()
    dialer = dial_tls(left, _tls(pipeline_keys, "s1"), "s0", expect_id="s0")
    acceptor.join(10)
    assert dialer.peer_id == "s0" and accepted[0].peer_id == "s1"
    ends = [FrameSocket(dialer, LinkLimits()), FrameSocket(accepted[0], LinkLimits())]
    batches, per_batch = 30, 10
    body = bytes(range(256)) * 240  # 60 KiB, the most a STATUS frame holds
    expected = {FrameKind.STATUS: body, FrameKind.PING: None}
    received: dict[int, list] = {0: [], 1: []}

    def write(end: FrameSocket, kind: FrameKind) -> None:
        for batch in range(batches):  # 600 KiB per write call: several chunks of records
            end.write(b"".join(encode_frame(kind, expected[kind] or b"",
                                            request_id=batch * per_batch + i)
                               for i in range(per_batch)))

    def read(index: int) -> None:
        for _ in range(2 * batches * per_batch):
            frame = ends[index].read()
            assert frame is not None
            received[index].append((frame.kind, frame.header.request_id,
                                    frame.payload == expected[frame.kind]))

    threads = [threading.Thread(target=read, args=(i,)) for i in (0, 1)]
    for end in ends:
        threads += [threading.Thread(target=write, args=(end, kind)) for kind in expected]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    for index in (0, 1):
        for kind in expected:
            mine = [r for r in received[index] if r[0] is kind]
            assert mine == [(kind, i, True) for i in range(batches * per_batch)]
    for end in ends:
        end.close()
