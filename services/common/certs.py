"""A certificate authority and per-process certificates for internal mutual TLS.

A certificate names its holder as ``spiffe://crescent/<role>/<name>`` (a URI subject
alternative name; the subject CN says the same as ``<role>/<name>``). Servers read the role
from the verified peer certificate (``services/common/access.py``). ``crescent up`` makes a
throwaway CA and one certificate per process in its run directory; ``crescent certs`` does the
same for operators (and makes ``admin`` certificates for debug tools).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("gateway", "scheduler", "prefill", "decode", "aggregated", "kvstore", "admin", "proxy")
SPIFFE_PREFIX = "spiffe://crescent/"
# Names servers are dialled by on one machine; add others with ``hosts``.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def role_uri(role: str, name: str) -> str:
    return f"{SPIFFE_PREFIX}{role}/{name}" if name else f"{SPIFFE_PREFIX}{role}"


@dataclass(frozen=True, slots=True)
class IssuedFiles:
    """Where one holder's files are: the CA to trust, its certificate and its key."""

    ca: Path
    cert: Path
    key: Path

    def settings(self) -> dict[str, str]:
        """The ``tls`` section of a service's settings pointing at these files."""
        return {"ca": str(self.ca), "cert": str(self.cert), "key": str(self.key)}


class CertificateAuthority:
    """An ECDSA P-256 CA that signs role certificates."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.key = key
        self.cert = cert

    @classmethod
    def create(cls, common_name: str = "crescent internal CA", days: int = 365) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> CertificateAuthority:
        key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path}: expected an EC private key")
        return cls(key, x509.load_pem_x509_certificate(Path(cert_path).read_bytes()))

    def issue(self, role: str, name: str = "", hosts: Iterable[str] = LOCAL_HOSTS,
              days: int = 365) -> tuple[bytes, bytes]:
        """A certificate (PEM) and its key (PEM) for ``role``/``name``, valid as client and server
        for ``hosts`` (DNS names or IP addresses)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(role_uri(role, name))]
        for host in dict.fromkeys(hosts):
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.timezone.utc)
        cn = f"{role}/{name}" if name else role
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return _key_pem(self.key)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a file only its owner can read (created 0600, never world-readable)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_pki(directory: Path, holders: Iterable[tuple[str, str]], hosts: Iterable[str] = LOCAL_HOSTS,
             ca: CertificateAuthority | None = None, days: int = 365) -> dict[tuple[str, str], IssuedFiles]:
    """A CA (new unless given) in ``directory`` and a certificate per ``(role, name)`` holder:
    ``ca.pem`` (and ``ca-key.pem``, 0600, to issue more), ``<name or role>.pem`` and ``-key.pem``."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    hosts = tuple(hosts)
    if ca is None:
        ca = CertificateAuthority.create(days=days)
        write_private(directory / "ca-key.pem", ca.key_pem())
        (directory / "ca.pem").write_bytes(ca.cert_pem())
    elif not (directory / "ca.pem").exists():
        (directory / "ca.pem").write_bytes(ca.cert_pem())
    issued = {}
    for role, name in holders:
        cert, key = ca.issue(role, name, hosts, days)
        stem = name or role
        (directory / f"{stem}.pem").write_bytes(cert)
        write_private(directory / f"{stem}-key.pem", key)
        issued[(role, name)] = IssuedFiles(directory / "ca.pem", directory / f"{stem}.pem", directory / f"{stem}-key.pem")
    return issued
