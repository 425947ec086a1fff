"""Pod lifecycle in the chart: preStop and the drain fit the termination grace period, and
`scheduler.kubernetesDiscovery` turns the scheduler's EndpointSlice discovery on for the very
Services and instance ids the engine pods have."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from crescent.services.scheduler.datatypes import Role
from crescent.services.scheduler.discovery import SERVICE_NAME_LABEL, endpoints_of
from tests.helm.test_chart import VALUES_FILES
from tests.helm.test_chart_settings import POD_FIELDS, _pod_env
from tests.helm.tools import NAMESPACE, by_kind, helm_template, render

DRAINING = ("gateway", "prefill", "decode", "aggregated")
MARGIN_S = 5  # what the chart leaves between the end of the drain and SIGKILL


def workloads_of(docs: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["labels"]["app.kubernetes.io/component"] == component]


def config_of(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return yaml.safe_load(by_kind(docs, "ConfigMap")[f"crescent-{component}"]["data"]["config.yaml"])


def drain_grace_of(docs: list[dict[str, Any]], component: str) -> float:
    """The gateway's own setting; prefill and decode drain in their engine's settings."""
    config = config_of(docs, component)
    return config["drain_grace_s"] if component == "gateway" else config["engine"]["drain_grace_s"]


@pytest.mark.parametrize("name", sorted(VALUES_FILES))
def test_draining_pods_sleep_in_prestop_then_drain_within_their_grace(name: str) -> None:
    docs = render("--set", "aggregated.enabled=true", values=VALUES_FILES[name])
    for component in DRAINING:
        workloads = workloads_of(docs, component)
        if not workloads:  # the example turns the role off
            continue
        drain = drain_grace_of(docs, component)
        for workload in workloads:
            spec = workload["spec"]["template"]["spec"]
            command = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
            assert command[0] == "sleep"
            sleep_s = int(command[1])
            assert sleep_s > 0
            # preStop, then the whole drain, then a margin to exit: all before SIGKILL.
            assert sleep_s + drain + MARGIN_S == spec["terminationGracePeriodSeconds"]


def test_grace_period_and_prestop_are_settable_and_zero_sleep_drops_the_hook() -> None:
    docs = render("--set", "decode.terminationGracePeriodSeconds=300", "--set", "decode.preStopSleepSeconds=0")
    (decode,) = workloads_of(docs, "decode")
    spec = decode["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == 300 and "lifecycle" not in spec["containers"][0]
    assert drain_grace_of(docs, "decode") == 300 - MARGIN_S


def test_a_grace_period_too_short_to_drain_in_is_refused() -> None:
    result = helm_template("--set", "gateway.terminationGracePeriodSeconds=8", "--set", "gateway.preStopSleepSeconds=5")
    assert result.returncode != 0
    assert "terminationGracePeriodSeconds (8) must exceed preStopSleepSeconds (5)" in result.stderr


@pytest.mark.parametrize("block_size_from", ["prefill", "decode", "aggregated"])
def test_kubernetes_discovery_watches_the_engines_services_under_their_instance_ids(block_size_from: str) -> None:
    docs = render("--set", "aggregated.enabled=true", "--set", f"{block_size_from}.settings.engine.block_size=32")
    discovery = config_of(docs, "scheduler")["discovery"]
    assert discovery["enabled"] is True and discovery["namespace"] == NAMESPACE
    assert discovery["model_id"] == "smollm2-135m-instruct" and discovery["block_size"] == 32
    services = by_kind(docs, "Service")
    scheduler = workloads_of(docs, "scheduler")[0]["spec"]["template"]["spec"]
    assert scheduler["automountServiceAccountToken"] is True
    (binding,) = by_kind(docs, "RoleBinding").values()
    assert binding["subjects"][0]["name"] == scheduler["serviceAccountName"]
    (role,) = by_kind(docs, "Role").values()
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["endpointslices"]
    for component, role_ in (("prefill", Role.PREFILL), ("decode", Role.DECODE), ("aggregated", Role.AGGREGATED)):
        service = services[discovery[f"{component}_service"]]
        grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == discovery["port_name"])
        container = workloads_of(docs, component)[0]["spec"]["template"]["spec"]["containers"][0]
        env = _pod_env(container)
        # The EndpointSlice Kubernetes would publish for this pod, read as discovery reads it.
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == grpc_port["targetPort"])
        slice_ = {
            "metadata": {"labels": {SERVICE_NAME_LABEL: service["metadata"]["name"]}},
            "ports": [{"name": grpc_port["name"], "port": port}],
            "endpoints": [{"addresses": [POD_FIELDS["POD_IP"]], "conditions": {"ready": True},
                           "targetRef": {"name": POD_FIELDS["POD_NAME"]}}],
        }
        (found,) = endpoints_of(slice_, role_, discovery["port_name"])
        # The pod registers itself under the id and address discovery gives it: one instance.
        assert found.instance_id == env[f"CRESCENT_{component.upper()}__INSTANCE_ID"]
        assert found.address == env[f"CRESCENT_{component.upper()}__ADVERTISE_ADDRESS"]


def test_without_kubernetes_discovery_the_scheduler_neither_watches_nor_holds_a_token() -> None:
    docs = render("--set", "scheduler.kubernetesDiscovery=false")
    assert "discovery" not in config_of(docs, "scheduler")
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")
    assert workloads_of(docs, "scheduler")[0]["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_kvstore_nodes_register_with_their_pod_address() -> None:
    """A kvstore node registers with the scheduler as a prefix source; engines dial the address it gives."""
    docs = render()
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    env = {e["name"]: e for e in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]}
    names = list(env)
    assert env["CRESCENT_KVSTORE__ADVERTISE_ADDRESS"]["value"].startswith("$(POD_IP):")
    assert names.index("POD_IP") < names.index("CRESCENT_KVSTORE__ADVERTISE_ADDRESS")  # $(VAR) needs it defined first
