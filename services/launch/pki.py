"""A certificate authority and one certificate per role, for a dev fleet's mutual TLS.

Why its own CA: with ``tls.client_auth`` every role checks its peers' certificates against
``tls.ca_file``, so the fleet's identities are exactly what this CA signed; a certificate from
any other CA (a public one included) is refused. A production fleet brings its own PKI; this is
for trying mutual TLS on a laptop or a few hosts without openssl recipes.

Every certificate serves both ways (extended key usage serverAuth and clientAuth: a role is a
server to some peers and a client of others) and names ``localhost``, ``127.0.0.1``, ``::1``,
its role (docker compose's service names are the roles) and the hosts given. Keys are ECDSA
P-256 (fast to make; gRPC, OpenSSL and Redis all take them), written with mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
CA_NAME = "ca"


@dataclass(frozen=True)
class Issued:
    """Where one certificate and its key were written."""

    name: str
    cert: Path
    key: Path


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def alt_names(names: Iterable[str]) -> list[x509.GeneralName]:
    """Each name as an IP address entry when it parses as one, else as a DNS name."""
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):  # once each, in order
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return entries


def _builder(subject: x509.Name, issuer: x509.Name, key, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # hosts' clocks differ a little
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )


def _key_usage(signs_certificates: bool) -> x509.KeyUsage:
    """A CA's key signs certificates and revocation lists; a role's key signs handshakes."""
    return x509.KeyUsage(
        digital_signature=not signs_certificates,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs_certificates,
        crl_sign=signs_certificates,
        encipher_only=False,
        decipher_only=False,
    )


def make_ca(common_name: str, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    usage = _key_usage(signs_certificates=True)
    builder = _builder(name, name, key, days)
    builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
    return builder.add_extension(usage, critical=True).sign(key, hashes.SHA256()), key


def issue(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    name: str,
    hosts: Sequence[str],
    days: int,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for ``name`` that serves and dials as every host in ``hosts``."""
    key = new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    usage = _key_usage(signs_certificates=False)
    both_ways = x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    authority = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key())
    builder = (
        _builder(subject, ca.subject, key, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(both_ways, critical=False)
        .add_extension(x509.SubjectAlternativeName(alt_names(hosts)), critical=False)
        .add_extension(authority, critical=False)
    )
    return builder.sign(ca_key, hashes.SHA256()), key


def write_pair(directory: Path, name: str, cert: x509.Certificate, key) -> Issued:
    """``name.pem`` (readable) and ``name.key`` (mode 0600, never readable by others)."""
    issued = Issued(name, directory / f"{name}.pem", directory / f"{name}.key")
    issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(issued.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        os.fchmod(out.fileno(), 0o600)  # an older file keeps its mode through O_TRUNC
        out.write(pem)
    return issued


def load_or_make_ca(directory: Path, days: int) -> tuple[x509.Certificate, object, bool]:
    """The CA in ``directory`` (``ca.pem``, ``ca.key``) when there is one, so certificates
    for more hosts join the same fleet later; else a new one. Returns (cert, key, new)."""
    cert_path, key_path = directory / f"{CA_NAME}.pem", directory / f"{CA_NAME}.key"
    if cert_path.exists() and key_path.exists():
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        return cert, key, False
    cert, key = make_ca(f"rlfleet dev CA ({directory.resolve().name})", days)
    write_pair(directory, CA_NAME, cert, key)
    return cert, key, True


def make_fleet(
    directory: Path, names: Sequence[str], hosts: Sequence[str], days: int, force: bool = False
) -> tuple[list[Issued], bool]:
    """A certificate per name in ``names`` under ``directory``, signed by its CA (made when
    missing). Refuses to replace an existing certificate unless ``force``. Returns what was
    issued and whether the CA is new."""
    if CA_NAME in names:
        raise ValueError(f"{CA_NAME!r} is the CA's own file name; pick another")
    directory.mkdir(parents=True, exist_ok=True)
    taken = [n for n in names if (directory / f"{n}.pem").exists()]
    if taken and not force:
        raise FileExistsError(f"{directory} already holds {', '.join(taken)} (--force replaces)")
    ca, ca_key, new = load_or_make_ca(directory, days)
    issued = []
    for name in names:
        cert, key = issue(ca, ca_key, name, [*LOCAL_NAMES, name, *hosts], days)
        issued.append(write_pair(directory, name, cert, key))
    return issued, new
