"""Mutual TLS for internal gRPC: settings, credentials, and the one way to open a channel.

Every process holds one key pair whose certificate names its role (``peer_identity``) and
trusts one PEM file of CA certificates (several during a CA rotation). Servers require a client
certificate signed by a trusted CA; clients verify the server's certificate the same way. With
no TLS settings a process speaks plaintext, which only a loopback listener may do unless
``allow_plaintext_non_loopback`` says the network is trusted (``check_listen``).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from pydantic import Field, model_validator

from crescent.services.common.settings import StrictModel

log = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0  # how often the key pair's files are looked at for a renewal


class TlsSettings(StrictModel):
    """Where this process's certificate, key and trusted CAs are (all three, or none)."""

    ca: str = Field(default="", description="PEM file of the CA certificate(s) peers must be signed by")
    cert: str = Field(default="", description="PEM file of this process's certificate (its role is in it)")
    key: str = Field(default="", description="PEM file of this process's private key (keep it 0600)")
    server_name: str = Field(
        default="", description="name to check in servers' certificates instead of the dialled host "
                                "(e.g. when certificates name a service, not each pod's address)",
    )
    allow_plaintext_non_loopback: bool = Field(
        default=False, description="serve plaintext gRPC on a non-loopback address anyway: any host that "
                                   "reaches the port can then call every RPC (trusted networks only)",
    )

    @model_validator(mode="after")
    def _all_or_none(self) -> TlsSettings:
        given = {name: bool(getattr(self, name)) for name in ("ca", "cert", "key")}
        if any(given.values()) and not all(given.values()):
            missing = ", ".join(f"tls.{name}" for name, ok in given.items() if not ok)
            raise ValueError(f"TLS needs ca, cert and key together; also set {missing}")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.ca)


class TlsError(RuntimeError):
    """TLS settings that cannot be used (unreadable files, plaintext where it is refused)."""


@dataclass(frozen=True, slots=True, eq=False)
class PeerTls:
    """This process's key pair and trusted CAs. Read from files (``load_tls``), it knows them
    (``files``), and ``latest`` is the newest contents: see ``tls_files``."""

    ca: bytes
    cert: bytes
    key: bytes
    server_name: str = ""
    files: TlsFiles | None = None

    def latest(self) -> PeerTls:
        """The key pair as its files hold it now (``self`` when it was not read from files)."""
        return self if self.files is None else self.files.current()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key or None,
                                            certificate_chain=self.cert or None)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that ask ``latest`` at every new connection: a renewed certificate (or a
        rotated CA) is served without a restart."""
        if self.files is None:
            return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                               require_client_auth=True)
        served = [self]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            latest = self.latest()
            if latest is served[0]:
                return None  # unchanged: gRPC keeps the configuration it has
            served[0] = latest
            return _server_configuration(latest)

        return grpc.dynamic_ssl_server_credentials(_server_configuration(self), fetch,
                                                   require_client_authentication=True)


def _server_configuration(tls: PeerTls) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(tls.key, tls.cert)], root_certificates=tls.ca)


class TlsFiles:
    """The three files of a key pair, re-read when they change (cert-manager renews a Secret's
    files in place; a CA rotation rewrites ca.crt). ``current`` looks at their modification times
    at most every ``CHECK_EVERY_S``; a half-written or unreadable set keeps the previous pair."""

    def __init__(self, settings: TlsSettings) -> None:
        self._paths = [Path(getattr(settings, name)).expanduser() for name in ("ca", "cert", "key")]
        self._server_name = settings.server_name
        self._checked_at = time.monotonic()
        self._stamp = self._stamps()
        self._current = self._read(strict=True)

    def current(self) -> PeerTls:
        now = time.monotonic()
        if now - self._checked_at < CHECK_EVERY_S:
            return self._current
        self._checked_at = now
        stamp = self._stamps()
        if stamp != self._stamp:
            fresh = self._read(strict=False)
            if fresh is not None:
                self._stamp, self._current = stamp, fresh
                log.info("TLS: read the renewed key pair in %s", ", ".join(map(str, self._paths)))
        return self._current

    def _stamps(self) -> tuple[tuple[int, int], ...]:
        stamps = []
        for path in self._paths:
            try:
                st = path.stat()
                stamps.append((st.st_mtime_ns, st.st_size))
            except OSError:
                stamps.append((0, -1))
        return tuple(stamps)

    def _read(self, *, strict: bool) -> PeerTls | None:
        data = []
        for name, path in zip(("ca", "cert", "key"), self._paths, strict=True):
            try:
                data.append(path.read_bytes())
            except OSError as exc:
                if strict:
                    raise TlsError(f"tls.{name}: cannot read {path}: {exc.strerror or exc}") from None
                log.warning("TLS: cannot read the renewed %s (%s); keeping the previous key pair", path, exc)
                return None
        ca, cert, key = data
        if not strict and not _pair_matches(cert, key):
            log.warning("TLS: the renewed certificate and key do not match (a renewal half-written?); "
                        "keeping the previous key pair")
            return None
        return PeerTls(ca, cert, key, self._server_name, self)


def _pair_matches(cert: bytes, key: bytes) -> bool:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        public = x509.load_pem_x509_certificate(cert).public_key()
        private = serialization.load_pem_private_key(key, password=None)
    except ValueError:
        return False
    raw = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    return public.public_bytes(*raw) == private.public_key().public_bytes(*raw)


def load_tls(settings: TlsSettings) -> PeerTls | None:
    """The files ``settings`` names, read; None when TLS is not configured."""
    if not settings.enabled:
        return None
    return TlsFiles(settings).current()


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname (or 0.0.0.0's spelling as "") may resolve to anything


def check_listen(service: str, host: str, settings: TlsSettings) -> None:
    """Refuse plaintext gRPC on an address other hosts can reach, unless overridden."""
    if settings.enabled or is_loopback(host):
        return
    if settings.allow_plaintext_non_loopback:
        log.warning("%s serves plaintext gRPC on %s: any host that reaches it can call every RPC "
                    "(tls.allow_plaintext_non_loopback is set)", service, host)
        return
    raise TlsError(
        f"{service}: refusing to serve plaintext gRPC on non-loopback address {host!r} (listen.host): "
        "any host that reaches it could register as an engine or read and replace KV blocks. "
        "Set tls.ca, tls.cert and tls.key (`crescent certs` makes them), bind 127.0.0.1, or set "
        "tls.allow_plaintext_non_loopback: true on a network you trust."
    )
