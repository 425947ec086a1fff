"""Every RPC of every service, called with each role's certificate, without one, with another
CA's and with one that names no role: only the roles in the access table get through.

The methods come from the protos' descriptors, so a new RPC is covered (and refused until the
table gives it a rule). The server is a real ``GrpcService`` with mutual TLS and the access
interceptor; behind it every method answers an empty reply, so a call that gets through is OK.
"""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio

from crescent.services.common.access import Peer, rule_for
from crescent.services.common.grpc_service import GrpcService
from crescent.services.common.settings import ListenSettings
from crescent.services.common.tls import TlsSettings
from tests.security.support import NAMES, all_methods, call, channel, full_name, make_test_pki, message, request_as



pytestmark = pytest.mark.asyncio(loop_scope="session")


def _answer_everything() -> list[grpc.GenericRpcHandler]:
    """Generic handlers that answer every method of every service with an empty reply."""
    by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
    for method in all_methods():
        reply = message(method.output_type)
        kwargs = {"request_deserializer": message(method.input_type).FromString,
                  "response_serializer": lambda m: m.SerializeToString()}
        if method.client_streaming:
            async def su(requests, context, reply=reply):
                async for _ in requests:
                    pass
                return reply()
            handler = grpc.stream_unary_rpc_method_handler(su, **kwargs)
        elif method.server_streaming:
            async def us(request, context, reply=reply):
                yield reply()
            handler = grpc.unary_stream_rpc_method_handler(us, **kwargs)
        else:
            async def uu(request, context, reply=reply):
                return reply()
            handler = grpc.unary_unary_rpc_method_handler(uu, **kwargs)
        by_service.setdefault(method.containing_service.full_name, {})[method.name] = handler
    return [grpc.method_handlers_generic_handler(name, handlers) for name, handlers in by_service.items()]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory):
    return make_test_pki(tmp_path_factory.mktemp("pki"))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(pki):
    async def setup(server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers(_answer_everything())

    service = GrpcService("everything", ListenSettings(), setup, tls=TlsSettings(**pki.server["scheduler"]))
    await service.start()
    yield f"127.0.0.1:{service.port}"
    await service.stop(0)


@pytest.mark.parametrize("role", list(NAMES))
async def test_each_role_reaches_exactly_the_methods_its_rules_allow(server: str, pki, role: str) -> None:
    peer = Peer(role, NAMES[role])
    outcomes = {}
    async with channel(server, pki.by_role[role]) as ch:
        for method in all_methods():
            code, details = await call(ch, method, request_as(method, peer))
            outcomes[method.name] = code
            allowed = role in rule_for(full_name(method)).roles
            expected = grpc.StatusCode.OK if allowed else grpc.StatusCode.PERMISSION_DENIED
            assert code == expected, f"{role} -> {full_name(method)}: {code} {details}"
            if not allowed:
                assert role in details and "may not call" in details
    # The scheduler calls nobody; the proxy calls only Envoy's ext_proc (tests/scheduler/test_endpoint_picker.py).
    assert grpc.StatusCode.OK in outcomes.values() or role in ("scheduler", "proxy")


@pytest.mark.parametrize("client", ["plaintext", "no certificate", "another CA"])
async def test_callers_without_a_trusted_certificate_reach_nothing(server: str, pki, client: str) -> None:
    tls = {"plaintext": None, "no certificate": pki.no_client_cert(), "another CA": pki.other_ca}[client]
    async with channel(server, tls) as ch:
        for method in all_methods():
            code, details = await call(ch, method, request_as(method, Peer("admin", "admin")), timeout_s=3)
            assert code == grpc.StatusCode.UNAVAILABLE, f"{client} -> {full_name(method)}: {code} {details}"


async def test_a_trusted_certificate_without_a_role_is_unauthenticated(server: str, pki) -> None:
    async with channel(server, pki.roleless) as ch:
        for method in all_methods():
            code, details = await call(ch, method, request_as(method, Peer("admin", "admin")))
            assert code == grpc.StatusCode.UNAUTHENTICATED, f"{full_name(method)}: {code}"
            assert "client certificate naming a Crescent role" in details


@pytest.mark.parametrize(("role", "claims", "instance_id"), [
    ("prefill", "decode", "prefill-0"),    # an engine registers only as its own role
    ("decode", "prefill", "decode-0"),
    ("kvstore", "prefill", "kvstore-0"),
    ("aggregated", "decode", "aggregated-0"),
    ("prefill", "aggregated", "prefill-0"),
    ("prefill", "prefill", "prefill-1"),   # ... and only under the name in its certificate
])
async def test_register_only_as_itself(server: str, pki, role: str, claims: str, instance_id: str) -> None:
    register = next(m for m in all_methods() if m.name == "Register")
    request = request_as(register, Peer(claims, instance_id))
    async with channel(server, pki.by_role[role]) as ch:
        code, details = await call(ch, register, request)
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert "may not act as" in details


@pytest.mark.parametrize("method_name", ["Heartbeat", "PublishBlockEvents", "Deregister"])
async def test_engines_report_only_for_themselves(server: str, pki, method_name: str) -> None:
    method = next(m for m in all_methods() if m.name == method_name)
    async with channel(server, pki.by_role["prefill"]) as ch:
        code, details = await call(ch, method, request_as(method, Peer("prefill", "prefill-1")))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "prefill-1" in details


async def test_a_ca_bundle_trusts_both_cas_during_a_rotation(pki, tmp_path_factory: pytest.TempPathFactory) -> None:
    """CA rotation: a server whose ``ca`` file holds the old and the new CA accepts both
    generations of client certificates, and both generations accept it."""
    from tests.security.support import make_test_pki

    new = make_test_pki(tmp_path_factory.mktemp("new-pki"))
    bundle = tmp_path_factory.mktemp("bundle") / "ca-bundle.pem"
    bundle.write_bytes(pki.by_role["admin"].ca + new.by_role["admin"].ca)
    tls = {**new.server["scheduler"], "ca": str(bundle)}

    async def setup(server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers(_answer_everything())

    service = GrpcService("rotating", ListenSettings(), setup, tls=TlsSettings(**tls))
    await service.start()
    list_instances = next(m for m in all_methods() if m.name == "ListInstances")
    try:
        for generation in (pki, new):
            client = generation.by_role["admin"]
            client = type(client)(bundle.read_bytes(), client.cert, client.key)  # clients trust both too
            async with channel(f"127.0.0.1:{service.port}", client) as ch:
                code, details = await call(ch, list_instances, request_as(list_instances, Peer("admin", "admin")))
            assert code == grpc.StatusCode.OK, details
        async with channel(f"127.0.0.1:{service.port}", pki.other_ca) as ch:
            code, _ = await call(ch, list_instances, request_as(list_instances, Peer("admin", "admin")))
        assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        await service.stop(0)
