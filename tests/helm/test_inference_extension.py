"""Gateway API Inference Extension: with inferenceExtension.enabled the chart renders an
InferencePool whose members are the gateway pods and whose endpoint picker is the scheduler
(Envoy ext_proc, services/scheduler/ext_proc.py); off, none of it. Also the kvstore's TCP side
channel, which the NetworkPolicy must open wherever the mover runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from crescent.services.kvstore.config import KvStoreSettings
from crescent.services.scheduler.config import SchedulerSettings
from tests.helm.test_internal_tls import CERT_MANAGER, PLAINTEXT, _settings, _workload
from tests.helm.test_placement import _matches
from tests.helm.tools import by_kind, helm_template, render

ON = ["--set", "inferenceExtension.enabled=true"]


def _container_port(docs: list[dict[str, Any]], component: str, name: str) -> int | None:
    container = _workload(docs, component)["spec"]["template"]["spec"]["containers"][0]
    return next((p["containerPort"] for p in container["ports"] if p["name"] == name), None)


def _policy_ports(docs: list[dict[str, Any]]) -> set[int]:
    """Ports the NetworkPolicies open to some of this release's own pods."""
    return {p["port"] for policy in by_kind(docs, "NetworkPolicy").values() for rule in policy["spec"]["ingress"]
            if "podSelector" in (rule.get("from") or [{}])[0] for p in rule["ports"]}


def test_off_by_default_nothing_of_it_renders(tmp_path: Path) -> None:
    docs = render()
    assert not by_kind(docs, "InferencePool")
    assert "crescent-endpoint-picker" not in by_kind(docs, "Service")
    assert "crescent-gateway-pods" not in by_kind(docs, "Service")
    settings, _ = _settings(tmp_path, docs, "scheduler")
    assert isinstance(settings, SchedulerSettings) and not settings.endpoint_picker.enabled
    assert _container_port(docs, "scheduler", "ext-proc") is None


def test_the_pool_routes_to_gateway_pods_and_names_the_schedulers_picker(tmp_path: Path) -> None:
    docs = render(*ON, "--set", "inferenceExtension.failureMode=FailOpen")
    (pool,) = by_kind(docs, "InferencePool").values()
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    gateway_pod = _workload(docs, "gateway")["spec"]["template"]["metadata"]["labels"]
    scheduler_pod = _workload(docs, "scheduler")["spec"]["template"]["metadata"]["labels"]
    assert _matches(spec["selector"], gateway_pod) and not _matches(spec["selector"], scheduler_pod)
    assert spec["targetPorts"] == [{"number": _container_port(docs, "gateway", "http")}]
    ref = spec["endpointPickerRef"]
    assert (ref["kind"], ref["failureMode"]) == ("Service", "FailOpen")
    service = by_kind(docs, "Service")[ref["name"]]
    (port,) = service["spec"]["ports"]
    assert port["port"] == ref["port"]["number"] == 9002
    assert _matches({"matchLabels": service["spec"]["selector"]}, scheduler_pod)
    assert _container_port(docs, "scheduler", port["targetPort"]) == 9002
    # The scheduler's own settings (as the service loads them) turn the picker on, on that port,
    # resolving the gateway pods through the headless Service.
    settings, _ = _settings(tmp_path, docs, "scheduler")
    picker = settings.endpoint_picker
    assert picker.enabled and picker.port == 9002
    host, _, gateway_port = picker.gateways.rpartition(":")
    assert host == "crescent-gateway-pods.serving.svc" and int(gateway_port) == spec["targetPorts"][0]["number"]
    headless = by_kind(docs, "Service")["crescent-gateway-pods"]["spec"]
    assert headless["clusterIP"] == "None" and _matches({"matchLabels": headless["selector"]}, gateway_pod)


def test_the_proxy_reaches_the_picker_through_the_network_policy() -> None:
    policy = by_kind(render(*ON, "--set-json", 'inferenceExtension.proxyNamespaceSelector={"matchLabels":{"kubernetes.io/metadata.name":"envoy-gateway-system"}}'),
                     "NetworkPolicy")["crescent-scheduler"]
    (rule,) = [r for r in policy["spec"]["ingress"] if {"protocol": "TCP", "port": 9002} in r.get("ports", [])]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}}}]
    off = by_kind(render(), "NetworkPolicy")["crescent-scheduler"]
    assert all({"protocol": "TCP", "port": 9002} not in r.get("ports", []) for r in off["spec"]["ingress"])


def test_with_cert_manager_the_picker_serves_the_schedulers_certificate_and_the_proxy_may_get_one(tmp_path: Path) -> None:
    docs = render(*ON, *CERT_MANAGER)
    certificates = by_kind(docs, "Certificate")
    assert {"crescent-endpoint-picker", "crescent-endpoint-picker.serving.svc"} <= set(certificates["crescent-scheduler"]["spec"]["dnsNames"])
    proxy = certificates["crescent-proxy"]["spec"]
    assert proxy["uris"] == ["spiffe://crescent/proxy"] and proxy["usages"] == ["digital signature", "client auth"]
    settings, _ = _settings(tmp_path, docs, "scheduler")
    assert settings.tls.enabled and settings.endpoint_picker.enabled  # the picker serves the scheduler's key pair
    assert settings.endpoint_picker.tls.client_certificate == "none"  # and asks for no client certificate


@pytest.mark.parametrize("args", [[], CERT_MANAGER, PLAINTEXT], ids=["self-signed", "cert-manager", "no-internal-tls"])
def test_the_picker_serves_tls_and_asks_for_no_client_certificate_by_default(tmp_path: Path, args: list[str]) -> None:
    """What every Gateway API proxy can dial, whatever the internal TLS: server-only TLS (without
    internal TLS, on a certificate the scheduler makes at start-up)."""
    settings, _ = _settings(tmp_path, render(*ON, *args), "scheduler")
    tls = settings.endpoint_picker.tls
    assert (tls.plaintext, tls.client_certificate, tls.cert) == (False, "none", "")
    docs = render(*ON, *args, "--set", "inferenceExtension.tls.enabled=false")
    assert _settings(tmp_path, docs, "scheduler")[0].endpoint_picker.tls.plaintext


def test_mutual_tls_for_the_picker_is_there_when_asked_for_and_internal_tls_is_on(tmp_path: Path) -> None:
    docs = render(*ON, "--set", "inferenceExtension.tls.clientCertificate=required")
    settings, _ = _settings(tmp_path, docs, "scheduler")
    assert settings.endpoint_picker.tls.client_certificate == "required" and settings.tls.ca
    assert "crescent-proxy-tls" in by_kind(docs, "Secret")  # what the proxy presents


async def test_a_proxy_checking_the_rendered_picker_certificate_by_its_service_name_is_answered(tmp_path: Path) -> None:
    """The default chart's picker as a proxy verifies it: the internal CA (ca.crt of
    <release>-proxy-tls), the name of Service <release>-endpoint-picker, no client certificate;
    ext_proc and grpc.health.v1 both answer."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from crescent.services.common.tls import PeerTls
    from crescent.services.scheduler.conductor import Conductor
    from crescent.services.scheduler.picker_server import build_picker_server
    from tests.helm.test_internal_tls import _pem
    from tests.ports import free_port

    docs = render(*ON)
    secrets = by_kind(docs, "Secret")
    scheduler_secret = secrets["crescent-scheduler-tls"]
    settings, _ = _settings(tmp_path, docs, "scheduler")
    picker = settings.endpoint_picker.model_copy(update={"port": free_port(), "gateways": "127.0.0.1:8000"})
    key_pair = PeerTls(_pem(scheduler_secret, "ca.crt"), _pem(scheduler_secret, "tls.crt"), _pem(scheduler_secret, "tls.key"))
    server = build_picker_server(Conductor(settings), picker, key_pair, "127.0.0.1")
    await server.start()
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=_pem(secrets["crescent-proxy-tls"], "ca.crt"))
        options = [("grpc.ssl_target_name_override", "crescent-endpoint-picker.serving.svc")]
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", credentials, options=options) as channel:
            check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=True))
            answers = [a async for a in pb_grpc.ExternalProcessorStub(channel).Process(iter([headers]), timeout=5)]
        (answer,) = answers
        (route,) = answer.request_headers.response.header_mutation.set_headers
        assert (route.header.key, route.header.raw_value) == ("x-gateway-destination-endpoint", b"127.0.0.1:8000")
    finally:
        await server.stop()


@pytest.mark.parametrize(("args", "message"), [
    ([*ON, "--set", "inferenceExtension.tls.clientCertificate=optional"], "clientCertificate"),
    ([*ON, "--set", "inferenceExtension.tls.clientCertificate=required", "--set", "inferenceExtension.tls.enabled=false"],
     "inferenceExtension.tls.enabled=true"),
    ([*ON, *PLAINTEXT, "--set", "inferenceExtension.tls.clientCertificate=required"], "internal CA"),
    ([*ON, "--set", "gateway.enabled=false"], "inferenceExtension.enabled"),
    ([*ON, "--set", "inferenceExtension.failureMode=Sometimes"], "failureMode"),
    ([*ON, "--set", "inferenceExtension.port=0"], "port"),
])
def test_settings_that_cannot_work_are_refused(args: list[str], message: str) -> None:
    result = helm_template(*args)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_the_network_policy_opens_the_kvstore_side_channel_where_the_tcp_mover_runs(tmp_path: Path) -> None:
    docs = render("--set", "kvstore.sideChannel.port=50099")
    settings, _ = _settings(tmp_path, docs, "kvstore")
    assert isinstance(settings, KvStoreSettings)
    assert settings.side_channel.enabled and settings.side_channel.port == 50099  # what the kvstore listens on
    assert 50099 in _policy_ports(docs)
    assert _container_port(docs, "kvstore", "side-channel") == 50099
    # A port set through kvstore.settings is the one the kvstore uses, so it is the one opened.
    docs = render("--set", "kvstore.settings.side_channel.port=50100")
    assert _settings(tmp_path, docs, "kvstore")[0].side_channel.port == 50100 and 50100 in _policy_ports(docs)
    # Mover off: nothing listens, nothing is opened.
    docs = render("--set", "kvstore.sideChannel.enabled=false")
    assert not _settings(tmp_path, docs, "kvstore")[0].side_channel.enabled
    assert 50055 not in _policy_ports(docs) and _container_port(docs, "kvstore", "side-channel") is None
