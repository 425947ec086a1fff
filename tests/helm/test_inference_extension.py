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
from tests.helm.test_internal_tls import CERT_MANAGER, _settings, _workload
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


def test_with_cert_manager_the_picker_serves_the_schedulers_certificate_and_the_proxy_gets_one(tmp_path: Path) -> None:
    docs = render(*ON, *CERT_MANAGER)
    certificates = by_kind(docs, "Certificate")
    assert {"crescent-endpoint-picker", "crescent-endpoint-picker.serving.svc"} <= set(certificates["crescent-scheduler"]["spec"]["dnsNames"])
    proxy = certificates["crescent-proxy"]["spec"]
    assert proxy["uris"] == ["spiffe://crescent/proxy"] and proxy["usages"] == ["digital signature", "client auth"]
    settings, _ = _settings(tmp_path, docs, "scheduler")
    assert settings.tls.enabled and settings.endpoint_picker.enabled  # one server's TLS for both ports


@pytest.mark.parametrize(("args", "message"), [
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
