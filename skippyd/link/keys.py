"""The pipeline's TLS keys: a CA of its own and one certificate per stage.

``skippyd link keygen`` writes them (:func:`write_pipeline_keys`). A stage certificate
names its stage in the subject's common name (``CN=stage-1``) and nothing else: no host
name, no address, so a stage keeps its certificate when it moves to another machine.
Each one is good for both ends of a connection, since a stage listens for its upstream
and dials its downstream. Keys are ECDSA P-256, written owner-only (0600); existing files
are never overwritten, and an existing CA in the directory is reused, so more stages
(or a monitoring tool) can join a pipeline later.

:func:`read_certificate`, :func:`stage_id_of` and :func:`signed_by` serve the checks of
a stage's ``link.tls_*`` files (``skippyd.link.tls``).
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from skippyd.config.schema import validate_stage_id

logger = logging.getLogger(__name__)

CA_CERT_FILE = "ca.crt"
CA_KEY_FILE = "ca.key"
#: How long a new stage certificate is valid, in days.
DEFAULT_DAYS = 730
#: How long a new CA is valid, in days (at least as long as what it signs).
CA_DAYS = 3650
#: New certificates start this long in the past: the clocks of the machines differ.
CLOCK_SKEW = datetime.timedelta(minutes=5)

PrivateKey = ec.EllipticCurvePrivateKey


class KeygenError(Exception):
    """The keys cannot be written (a file exists, a CA is half there, bad input)."""


@dataclass(frozen=True, slots=True)
class StageKeys:
    """Where one stage's certificate and key are."""

    stage_id: str
    cert: Path
    key: Path


@dataclass(frozen=True, slots=True)
class PipelineKeys:
    """What :func:`write_pipeline_keys` wrote (or reused)."""

    ca_cert: Path
    ca_key: Path
    ca_created: bool
    stages: list[StageKeys]


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _new_key() -> PrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def make_ca(*, days: int = CA_DAYS, now: datetime.datetime | None = None
            ) -> tuple[x509.Certificate, PrivateKey]:
    """A new pipeline CA: self-signed, allowed to sign stage certificates only.

    Its name carries a random suffix, so two pipelines' CAs are told apart in messages.
    """
    start = (now or _now()) - CLOCK_SKEW
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                         f"skippyd pipeline CA {secrets.token_hex(4)}")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def issue_stage_cert(ca_cert: x509.Certificate, ca_key: PrivateKey, stage_id: str, *,
                     not_before: datetime.datetime | None = None,
                     not_after: datetime.datetime | None = None,
                     days: int = DEFAULT_DAYS) -> tuple[x509.Certificate, PrivateKey]:
    """A certificate for ``stage_id`` signed by the pipeline CA, and its new key.

    The validity defaults to ``days`` from now (less :data:`CLOCK_SKEW`), never past the
    CA's own end.
    """
    start = not_before or (_now() - CLOCK_SKEW)
    end = not_after or min(start + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    key = _new_key()
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, stage_id)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
                ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_new_file(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` (never widened by the umask's absence, never
    replacing a file) and write ``data``.

    Raises:
        FileExistsError: ``path`` exists.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)


def read_certificate(path: Path) -> x509.Certificate:
    """Raises ``OSError`` (unreadable) or ``ValueError`` (not a PEM certificate)."""
    return x509.load_pem_x509_certificate(path.read_bytes())


def read_private_key(path: Path) -> PrivateKey:
    """Raises ``OSError`` (unreadable) or ``ValueError`` (not an unencrypted EC key)."""
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except TypeError:  # a key protected by a passphrase
        raise ValueError("the key is protected by a passphrase") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("not an EC private key")
    return key


def stage_id_of(cert: x509.Certificate) -> str | None:
    """The stage a certificate names (its subject's common name), or None."""
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        return None
    value = names[0].value
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


def is_ca(cert: x509.Certificate) -> bool:
    """Whether ``cert`` may sign certificates (its basic constraints say CA)."""
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """Whether ``ca`` issued ``cert`` (its name and its signature)."""
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _load_or_make_ca(directory: Path, days: int) -> tuple[x509.Certificate, PrivateKey, bool]:
    """The CA in ``directory`` if there is one (True: made now)."""
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    have = cert_path.exists(), key_path.exists()
    if have == (False, False):
        cert, key = make_ca(days=max(CA_DAYS, days))
        return cert, key, True
    if have != (True, True):
        present, missing = (cert_path, key_path) if have[0] else (key_path, cert_path)
        raise KeygenError(f"{present} exists but {missing} does not: a CA needs both")
    try:
        cert, key = read_certificate(cert_path), read_private_key(key_path)
    except (OSError, ValueError) as exc:
        raise KeygenError(f"cannot reuse the CA in {directory}: {exc}") from None
    if cert.public_key() != key.public_key():
        raise KeygenError(f"{key_path} is not the key of {cert_path}")
    if cert.not_valid_after_utc <= _now():
        raise KeygenError(f"the CA in {cert_path} expired on "
                          f"{cert.not_valid_after_utc:%Y-%m-%d}; use a new directory")
    return cert, key, False


def write_pipeline_keys(directory: Path, stage_ids: Sequence[str],
                        days: int = DEFAULT_DAYS) -> PipelineKeys:
    """Write (or reuse) the pipeline CA in ``directory`` and a certificate and key per
    stage id (``<id>.crt``, ``<id>.key``).

    Nothing is written when any stage's file already exists or the input is bad.

    Raises:
        KeygenError: A file exists, the CA in the directory cannot be reused, or
            ``stage_ids`` is empty or repeats an id.
        OSError: The directory cannot be created or written.
    """
    if not stage_ids:
        raise KeygenError("no stage to write a certificate for")
    if len(set(stage_ids)) != len(stage_ids):
        raise KeygenError("a stage id is given twice")
    if days < 1:
        raise KeygenError(f"days must be at least 1 (got {days})")
    for stage_id in stage_ids:
        try:
            validate_stage_id(stage_id)
        except ValueError as exc:
            raise KeygenError(f"stage id {stage_id!r}: {exc}") from None
        if f"{stage_id}.crt" == CA_CERT_FILE:
            raise KeygenError(f'"{stage_id}" would be the CA\'s file name; choose another id')
    if directory.exists() and not directory.is_dir():
        raise KeygenError(f"{directory} is not a directory")
    stages = [StageKeys(i, directory / f"{i}.crt", directory / f"{i}.key") for i in stage_ids]
    existing = [p for s in stages for p in (s.cert, s.key) if p.exists()]
    if existing:
        raise KeygenError(f"{existing[0]} exists; keygen never overwrites a key or a "
                          "certificate (remove it, or use another directory)")
    ca_cert, ca_key, created = _load_or_make_ca(directory, days)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if created:
        write_new_file(directory / CA_KEY_FILE, key_pem(ca_key), 0o600)
        write_new_file(directory / CA_CERT_FILE, cert_pem(ca_cert), 0o644)
    for stage in stages:
        cert, key = issue_stage_cert(ca_cert, ca_key, stage.stage_id, days=days)
        write_new_file(stage.key, key_pem(key), 0o600)
        write_new_file(stage.cert, cert_pem(cert), 0o644)
    return PipelineKeys(directory / CA_CERT_FILE, directory / CA_KEY_FILE, created, stages)
