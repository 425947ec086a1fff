"""Who may call what: one table per gRPC service, enforced by one server interceptor.

A caller's role comes from its verified client certificate (``spiffe://crescent/<role>/<name>``,
see ``certs.py``; one without that URI may carry the id as its whole subject CN); mutual TLS has
already refused callers without a certificate from a trusted CA before any of this runs. Each method lists the roles that may call it; a method missing from
its table is refused (a new RPC is closed until someone decides who may call it; the tests
check every method in the protos has a rule). Some rules also check what the request claims:
an engine registers, heartbeats and publishes only as itself.

Refusals: UNAUTHENTICATED when the certificate names no Crescent role, PERMISSION_DENIED when
the role may not make the call or the request claims another identity.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from cryptography import x509
from cryptography.x509.oid import NameOID

from crescent.protos import decode_pb2, kvstore_pb2, prefill_pb2, scheduler_pb2
from crescent.services.common.certs import SPIFFE_PREFIX

log = logging.getLogger(__name__)

GATEWAY, SCHEDULER, PREFILL, DECODE, KVSTORE, ADMIN = "gateway", "scheduler", "prefill", "decode", "kvstore", "admin"
PROXY = "proxy"  # the Gateway API proxy (Envoy) that asks the scheduler's endpoint picker where to route
AGGREGATED = "aggregated"  # an engine that prefills and decodes: what either may do
ENGINES = frozenset({PREFILL, DECODE, AGGREGATED})
PREFILLERS = frozenset({PREFILL, AGGREGATED})  # what prefills, so hands off and pulls prefixes
REGISTRANTS = ENGINES | {KVSTORE}  # what registers with the scheduler and publishes block events


@dataclass(frozen=True, slots=True)
class Peer:
    """A caller as its certificate names it; ``name`` is empty for a role-wide certificate."""

    role: str
    name: str


# What a request says about its sender: (role, instance id); None where it says nothing.
Claim = Callable[[Any], tuple[str | None, str | None]]


@dataclass(frozen=True, slots=True)
class Rule:
    roles: frozenset[str]
    claim: Claim | None = None  # the request must name the caller itself (not admin's calls)


def rule(*roles: str, claim: Claim | None = None) -> Rule:
    return Rule(frozenset(roles), claim)


_ROLE_OF_INSTANCE = {scheduler_pb2.INSTANCE_ROLE_PREFILL: PREFILL, scheduler_pb2.INSTANCE_ROLE_DECODE: DECODE,
                     scheduler_pb2.INSTANCE_ROLE_KVSTORE: KVSTORE, scheduler_pb2.INSTANCE_ROLE_AGGREGATED: AGGREGATED}


def _registers(info: scheduler_pb2.InstanceInfo) -> tuple[str | None, str | None]:
    return _ROLE_OF_INSTANCE.get(info.role, "unspecified"), info.instance_id


def _service(module: Any, name: str) -> str:
    return module.DESCRIPTOR.services_by_name[name].full_name


# -- the tables: service full name -> method -> rule ----------------------------------------------

SCHEDULER_RULES = {
    "Register": rule(*REGISTRANTS, claim=_registers),
    "Heartbeat": rule(*REGISTRANTS, claim=lambda r: (None, r.instance_id)),
    "PublishBlockEvents": rule(*REGISTRANTS, claim=lambda r: (None, r.source_id)),
    "Deregister": rule(*REGISTRANTS, ADMIN, claim=lambda r: (None, r.instance_id)),
    "Place": rule(GATEWAY),
    "ReportOutcome": rule(GATEWAY),
    # Addresses, ids and load (no prompts): the gateway's /health, prefill's peer directory.
    "ListInstances": rule(GATEWAY, *PREFILLERS, ADMIN),
}
KVSTORE_RULES = {
    # Engines write blocks; a kvstore node writes to a peer when it replicates.
    "Put": rule(*ENGINES, KVSTORE),
    "PutShm": rule(*ENGINES),
    # The reserve/commit control calls of every byte mover (shared memory, the TCP side
    # channel, NIXL); a kvstore node replicating to a peer moves blocks like an engine.
    "ReserveShm": rule(*ENGINES, KVSTORE),
    "CommitShm": rule(*ENGINES, KVSTORE),
    # Same-GPU moves through CUDA IPC regions: only an engine shares the node's GPU.
    "PutRegion": rule(*ENGINES),
    "GetRegion": rule(*ENGINES),
    # Blocks hold every tenant's prompt tokens: engines, peer nodes and operators only.
    "Get": rule(*ENGINES, KVSTORE, ADMIN),
    "GetShm": rule(*ENGINES, KVSTORE),  # peers' lookups over the side channel
    "Exists": rule(*ENGINES, KVSTORE, ADMIN),
    "Remove": rule(*ENGINES, KVSTORE, ADMIN),  # readers report corrupt blocks
    "Stat": rule(*ENGINES, KVSTORE, ADMIN),
    "Replicate": rule(ADMIN),
    "List": rule(ADMIN),
}
PREFILL_RULES = {
    "Prefill": rule(GATEWAY),
    "FetchPrefix": rule(*PREFILLERS),  # a peer pulling a hot prefix
}
DECODE_RULES = {
    "Handoff": rule(*PREFILLERS),
    "OpenHandoff": rule(*PREFILLERS),  # room on the handoff side channel, for a Handoff to come
    "StreamTokens": rule(GATEWAY),
    "Abort": rule(GATEWAY),
}
# Envoy's ext_proc, served by the scheduler's endpoint picker (scheduler/ext_proc.py) on its own port.
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
EXT_PROC_RULES = {"Process": rule(PROXY)}
ACCESS: dict[str, dict[str, Rule]] = {
    _service(scheduler_pb2, "Scheduler"): SCHEDULER_RULES,
    _service(kvstore_pb2, "KvStore"): KVSTORE_RULES,
    _service(prefill_pb2, "Prefill"): PREFILL_RULES,
    _service(decode_pb2, "Decode"): DECODE_RULES,
    EXT_PROC_SERVICE: EXT_PROC_RULES,
}


def rule_for(method: str) -> Rule | None:
    """The rule of a full method name (``/crescent.v1.Scheduler/Register``); None: no rule."""
    service, _, name = method.lstrip("/").rpartition("/")
    return ACCESS.get(service, {}).get(name)


# -- identity ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1024)
def identity_of_cert(pem: bytes) -> Peer | None:
    """The Crescent identity in a (verified) certificate: its ``spiffe://crescent/`` URI SAN.

    A certificate with no such URI may name the identity as its whole subject CN instead
    (``CN=spiffe://crescent/gateway``): the chart's self-signed mode signs with Helm's
    ``genSignedCert``, which cannot write a URI SAN. A plain CN (``gateway``) names no role."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    except ValueError:  # a malformed extension
        return None
    spiffe = [uri for uri in uris if uri.startswith(SPIFFE_PREFIX)]
    if not spiffe:
        common_names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if len(common_names) != 1 or not isinstance(common_names[0].value, str):
            return None
        spiffe = [common_names[0].value]
    for uri in spiffe:
        peer = _peer_of_id(uri)
        if peer is not None:
            return peer
    return None


def _peer_of_id(spiffe_id: str) -> Peer | None:
    """``spiffe://crescent/<role>[/<name>]`` as a Peer; None for anything else."""
    if not spiffe_id.startswith(SPIFFE_PREFIX):
        return None
    role, _, name = spiffe_id[len(SPIFFE_PREFIX):].partition("/")
    return Peer(role, name) if role else None


def peer_of(context: grpc.aio.ServicerContext) -> Peer | None:
    """The caller's identity from the TLS handshake; None over plaintext or without a role."""
    pems = context.auth_context().get("x509_pem_cert")
    return identity_of_cert(pems[0]) if pems else None


def refusal(method: str, peer: Peer | None, request: Any) -> tuple[grpc.StatusCode, str] | None:
    """Why ``peer`` may not call ``method`` with ``request`` (None: it may)."""
    if peer is None:
        return grpc.StatusCode.UNAUTHENTICATED, f"{method} needs a client certificate naming a Crescent role"
    found = rule_for(method)
    if found is None:
        return grpc.StatusCode.PERMISSION_DENIED, f"{method} has no access rule; refused for every role"
    if peer.role not in found.roles:
        allowed = ", ".join(sorted(found.roles))
        return grpc.StatusCode.PERMISSION_DENIED, f"role {peer.role!r} may not call {method} (allowed: {allowed})"
    if found.claim is not None and request is not None and peer.role != ADMIN:
        role, instance_id = found.claim(request)
        if role is not None and role != peer.role:
            return grpc.StatusCode.PERMISSION_DENIED, f"a {peer.role} certificate may not act as a {role} in {method}"
        if peer.name and instance_id is not None and instance_id != peer.name:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"certificate of {peer.name!r} may not act as instance {instance_id!r} in {method}")
    return None


# -- the interceptor ---------------------------------------------------------------------------------

Check = Callable[[grpc.aio.ServicerContext, Any], Awaitable[None]]


class AccessControl(grpc.aio.ServerInterceptor):
    """Checks every call against ``ACCESS`` before the servicer sees it (mutual TLS servers only)."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None  # not served here: UNIMPLEMENTED as usual
        method = details.method

        async def check(context: grpc.aio.ServicerContext, request: Any) -> None:
            peer = peer_of(context)
            refused = refusal(method, peer, request)
            if refused is not None:
                code, message = refused
                log.warning("refused %s from %s (%s): %s", method, context.peer(), peer, message)
                await context.abort(code, message)

        return _guarded(handler, check)


def _guarded(handler: grpc.RpcMethodHandler, check: Check) -> grpc.RpcMethodHandler:
    """``handler`` with ``check`` run first (with the request, where there is one request)."""
    serializers = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context, request)
            return await _result(inner_uu(request, context))

        return grpc.unary_unary_rpc_method_handler(unary_unary, **serializers)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context, None)
            return await _result(inner_su(requests, context))

        return grpc.stream_unary_rpc_method_handler(stream_unary, **serializers)
    inner = handler.unary_stream if handler.unary_stream is not None else handler.stream_stream

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await check(context, request if handler.unary_stream is not None else None)
        result = inner(request, context)
        if hasattr(result, "__aiter__"):
            async for item in result:
                yield item
        else:  # a coroutine that writes with context.write, or a plain iterator
            result = await _result(result)
            for item in result or ():
                yield item

    make = grpc.unary_stream_rpc_method_handler if handler.unary_stream is not None else grpc.stream_stream_rpc_method_handler
    return make(streaming, **serializers)


async def _result(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def interceptors(enabled: bool) -> list[grpc.aio.ServerInterceptor]:
    """The server interceptors of a service: access control when its callers are authenticated."""
    return [AccessControl()] if enabled else []


def rules_table() -> Mapping[str, Mapping[str, Rule]]:
    """Every service's rules (for docs and tests)."""
    return ACCESS
