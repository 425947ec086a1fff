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
from dataclasses import dataclass
from pathlib import Path

import grpc
from pydantic import Field, model_validator

from crescent.services.common.settings import StrictModel

log = logging.getLogger(__name__)


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


@dataclass(frozen=True, slots=True)
class PeerTls:
    """This process's key pair and trusted CAs, read once at start-up (rotation = restart)."""

    ca: bytes
    cert: bytes
    key: bytes
    server_name: str = ""

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key or None,
                                            certificate_chain=self.cert or None)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)


def load_tls(settings: TlsSettings) -> PeerTls | None:
    """The files ``settings`` names, read; None when TLS is not configured."""
    if not settings.enabled:
        return None
    data = {}
    for name in ("ca", "cert", "key"):
        path = Path(getattr(settings, name)).expanduser()
        try:
            data[name] = path.read_bytes()
        except OSError as exc:
            raise TlsError(f"tls.{name}: cannot read {path}: {exc.strerror or exc}") from None
    return PeerTls(data["ca"], data["cert"], data["key"], settings.server_name)


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
