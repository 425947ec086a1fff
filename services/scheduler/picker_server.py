"""The endpoint picker's own gRPC server: Envoy's ext_proc and ``grpc.health.v1`` on one port.

How a proxy reaches it (``endpoint_picker.tls``), shaped by what Gateway API proxies can do:

- TLS without a client certificate, by default, as the upstream picker serves it (some
  implementations cannot dial a plaintext ext_proc server, and only Istio can be made to present
  a client certificate). The key pair is ``endpoint_picker.tls.cert``/``key`` if set, else the
  scheduler's own (the chart's names the picker's Service), else a self-signed one made at
  start-up, which proxies take without verifying, as they take the upstream picker's.
- ``client_certificate: required``: mutual TLS; the proxy's certificate must be signed by
  ``client_ca`` (default: the scheduler's CA) and name the ``proxy`` role (access.py's rule).
- ``plaintext``: no TLS, when asked for by name (logged as a warning off loopback): the picker
  hands out routes, never prompts' tokens or KV, so the scheduler's plaintext rule is not its.

Health (the Inference Extension's protocol requires it): services ``""``, ``liveness``,
``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` answer SERVING from start until
the scheduler stops, when all but ``liveness`` turn NOT_SERVING. Health calls need no role: any
caller that completed the TLS handshake may ask.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from crescent.services.common.access import AccessControl
from crescent.services.common.grpc_service import GRPC_OPTIONS
from crescent.services.common.tls import PeerTls, TlsError, is_loopback
from crescent.services.scheduler.conductor import Conductor
from crescent.services.scheduler.config import EndpointPickerSettings
from crescent.services.scheduler.endpoint_picker import EndpointPicker, GatewayEndpoints
from crescent.services.scheduler.ext_proc import SERVICE as EXT_PROC_SERVICE
from crescent.services.scheduler.ext_proc import ExternalProcessorServicer, pb_grpc

log = logging.getLogger(__name__)

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
LIVENESS, READINESS = "liveness", "readiness"
READY_SERVICES = ("", READINESS, EXT_PROC_SERVICE)  # NOT_SERVING once the scheduler stops
SELF_SIGNED_DAYS = 365


@dataclass(frozen=True, slots=True)
class PickerTransport:
    """What the picker's port serves: credentials (None: plaintext) and whether callers are
    authenticated (mutual TLS, roles checked)."""

    credentials: grpc.ServerCredentials | None
    mutual: bool
    description: str


def picker_transport(settings: EndpointPickerSettings, scheduler_tls: PeerTls | None, host: str) -> PickerTransport:
    """The picker's credentials from its settings and the scheduler's key pair."""
    s = settings.tls
    if s.plaintext:  # asked for by name: the picker hands out routes, not prompts or KV
        if not is_loopback(host):
            log.warning("endpoint picker serves plaintext ext_proc on %s (endpoint_picker.tls.plaintext): any host that "
                        "reaches the port can ask for routes and see which gateway pods exist", host)
        return PickerTransport(None, False, "plaintext")
    if s.cert:
        cert, key = _read(s.cert, "endpoint_picker.tls.cert"), _read(s.key, "endpoint_picker.tls.key")
        source = s.cert
    elif scheduler_tls is not None:
        cert, key, source = scheduler_tls.cert, scheduler_tls.key, "the scheduler's certificate"
    else:
        cert, key = self_signed(host)
        source = "a self-signed certificate made at start-up"
    if s.client_certificate == "none":
        return PickerTransport(grpc.ssl_server_credentials([(key, cert)]), False, f"TLS ({source}), no client certificate")
    ca = _read(s.client_ca, "endpoint_picker.tls.client_ca") if s.client_ca else scheduler_tls.ca if scheduler_tls else b""
    if not ca:
        raise TlsError("endpoint_picker.tls.client_certificate: required needs endpoint_picker.tls.client_ca or tls.ca")
    credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    return PickerTransport(credentials, True, f"mutual TLS ({source}), the proxy role's certificate required")


def _read(path: str, setting: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise TlsError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from None


def self_signed(host: str, days: int = SELF_SIGNED_DAYS) -> tuple[bytes, bytes]:
    """A self-signed certificate (PEM) and its key for the picker, naming this host. It is its
    own CA, so a client may also pin it as the one root it trusts."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName(socket.gethostname())]
    for address in ("127.0.0.1", "::1", *([host] if host and host not in ("0.0.0.0", "::") else [])):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(address.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(address))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "crescent endpoint picker (self-signed)")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectAlternativeName(list(dict.fromkeys(names))), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


class PickerAccess(grpc.aio.ServerInterceptor):
    """Mutual TLS only: health checks pass for any verified caller; everything else goes through
    the access table (``Process``: the proxy role)."""

    def __init__(self) -> None:
        self._roles = AccessControl()

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return await continuation(details)
        return await self._roles.intercept_service(continuation, details)


class PickerServer:
    """The picker's gRPC server for the life of the scheduler: ``start`` binds and serves,
    ``stop`` turns readiness off and closes it."""

    def __init__(self, picker: EndpointPicker, transport: PickerTransport, address: str) -> None:
        self.picker = picker
        self.transport = transport
        self.address = address
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=[PickerAccess()] if transport.mutual else [])
        pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessorServicer(picker), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0

    async def start(self) -> int:
        if self.transport.credentials is None:
            bound = self.server.add_insecure_port(self.address)
        else:
            bound = self.server.add_secure_port(self.address, self.transport.credentials)
        if bound == 0:
            raise RuntimeError(f"scheduler: cannot listen on {self.address} (endpoint_picker.port)")
        await self.server.start()
        for service in (LIVENESS, *READY_SERVICES):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.port = bound
        return bound

    async def stop(self, grace_s: float = 1.0) -> None:
        for service in READY_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)


def build_picker_server(conductor: Conductor, settings: EndpointPickerSettings, scheduler_tls: PeerTls | None,
                        host: str) -> PickerServer:
    """The picker (over ``conductor``) behind its server, not yet started."""
    picker = EndpointPicker(conductor, GatewayEndpoints(settings.gateways, settings.refresh_s))
    transport = picker_transport(settings, scheduler_tls, host)
    return PickerServer(picker, transport, f"{host}:{settings.port}")
