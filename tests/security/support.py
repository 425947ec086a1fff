"""PKI and channels for the security tests: certificates per role from a test CA, another CA,
a certificate without a role, and a client for every method from the service descriptors."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor

from crescent.protos import decode_pb2, kvstore_pb2, prefill_pb2, scheduler_pb2
from crescent.services.common.access import Peer
from crescent.services.common.certs import ROLES, CertificateAuthority, make_pki, write_private
from crescent.services.common.grpc_service import open_channel
from crescent.services.common.tls import PeerTls, TlsSettings, load_tls

SERVICES = [(scheduler_pb2, "Scheduler"), (kvstore_pb2, "KvStore"), (prefill_pb2, "Prefill"), (decode_pb2, "Decode")]
# The name each role's certificate carries (engines and kvstores register under it).
NAMES = {"gateway": "gateway", "scheduler": "scheduler", "prefill": "prefill-0", "decode": "decode-0",
         "aggregated": "aggregated-0", "kvstore": "kvstore-0", "admin": "admin", "proxy": "envoy"}


def all_methods() -> list[MethodDescriptor]:
    """Every RPC of every Crescent service, from the protos' descriptors (new ones included)."""
    return [m for module, name in SERVICES for m in module.DESCRIPTOR.services_by_name[name].methods]


def full_name(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def message(descriptor) -> type:
    return message_factory.GetMessageClass(descriptor)


def request_as(method: MethodDescriptor, peer: Peer):
    """A request to ``method`` in which ``peer`` claims to be itself (what an honest caller sends)."""
    request = message(method.input_type)()
    roles = {"prefill": scheduler_pb2.INSTANCE_ROLE_PREFILL, "decode": scheduler_pb2.INSTANCE_ROLE_DECODE,
             "kvstore": scheduler_pb2.INSTANCE_ROLE_KVSTORE, "aggregated": scheduler_pb2.INSTANCE_ROLE_AGGREGATED}
    if method.name == "Register":
        request.instance_id = peer.name
        request.role = roles.get(peer.role, scheduler_pb2.INSTANCE_ROLE_UNSPECIFIED)
    elif method.name in ("Heartbeat", "Deregister"):
        request.instance_id = peer.name
    elif method.name == "PublishBlockEvents":
        request.source_id = peer.name
    return request


@dataclass(frozen=True)
class Pki:
    directory: Path
    by_role: dict[str, PeerTls]     # signed by the platform's CA
    other_ca: PeerTls               # an admin certificate from an unrelated CA
    roleless: PeerTls               # signed by the platform's CA, but no crescent role in it
    server: dict[str, dict[str, str]]  # tls settings per role (files)

    def no_client_cert(self) -> PeerTls:
        """Trusts the platform's CA but presents no certificate (an empty key pair)."""
        return PeerTls(self.by_role["admin"].ca, b"", b"")


def make_test_pki(directory: Path) -> Pki:
    issued = make_pki(directory / "main", [(role, NAMES[role]) for role in ROLES])
    by_role = {role: load_tls(TlsSettings(**issued[(role, NAMES[role])].settings())) for role in ROLES}
    other = make_pki(directory / "other", [("admin", "admin")])[("admin", "admin")]
    ca = CertificateAuthority.load(directory / "main" / "ca.pem", directory / "main" / "ca-key.pem")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "nobody")]))
            .issuer_name(ca.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(ca.cert.not_valid_before_utc).not_valid_after(ca.cert.not_valid_after_utc)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(ca.key, hashes.SHA256()))
    (directory / "roleless.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_private(directory / "roleless-key.pem", key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    roleless = load_tls(TlsSettings(ca=str(directory / "main" / "ca.pem"), cert=str(directory / "roleless.pem"),
                                    key=str(directory / "roleless-key.pem")))
    return Pki(directory, by_role, load_tls(TlsSettings(**other.settings())), roleless,
               {role: issued[(role, NAMES[role])].settings() for role in ROLES})


async def call(channel: grpc.aio.Channel, method: MethodDescriptor, request, timeout_s: float = 5.0):
    """Call any method generically: returns the status code (OK when it was let through)."""
    path = full_name(method)
    serialize = lambda m: m.SerializeToString()  # noqa: E731
    parse = message(method.output_type).FromString
    try:
        if method.client_streaming and method.server_streaming:
            raise AssertionError(f"{path}: no bidirectional RPCs are expected")
        if method.client_streaming:
            await channel.stream_unary(path, request_serializer=serialize, response_deserializer=parse)(
                iter([request]), timeout=timeout_s)
        elif method.server_streaming:
            async for _ in channel.unary_stream(path, request_serializer=serialize, response_deserializer=parse)(
                    request, timeout=timeout_s):
                pass
        else:
            await channel.unary_unary(path, request_serializer=serialize, response_deserializer=parse)(
                request, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def channel(address: str, tls: PeerTls | None) -> grpc.aio.Channel:
    return open_channel(address, tls)


def iter_roles() -> Iterator[str]:
    yield from ROLES
