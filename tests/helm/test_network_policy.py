"""Who may reach which port, evaluated over the rendered NetworkPolicies as Kubernetes does: the
gateway (open to the internet) reaches the scheduler and the engines' front doors but never the
kvstore nor a side channel; the kvstore and the side channels admit the engines that use them;
admin ports admit the monitoring namespace only; the helm test pod reaches the gateway alone."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helm.netpol import admits, selects
from tests.helm.tools import render

AGGREGATED_ON = ["--set", "aggregated.enabled=true"]
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
ELSEWHERE = {"kubernetes.io/metadata.name": "default"}
PORTS = {"scheduler": 50051, "prefill": 50052, "decode": 50053, "kvstore": 50054, "aggregated": 50056,
         "kvstore-side": 50055, "decode-side": 50057, "admin": 9090, "gateway": 8000}


def pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Pod labels by component, from every workload (and the helm test pod)."""
    found = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "DaemonSet"):
            labels = doc["spec"]["template"]["metadata"]["labels"]
            found[labels["app.kubernetes.io/component"]] = labels
        elif doc["kind"] == "Pod":
            found[doc["metadata"]["labels"]["app.kubernetes.io/component"]] = doc["metadata"]["labels"]
    return found


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render(*AGGREGATED_ON)


# (caller, target, port name, admitted)
MATRIX = [
    ("gateway", "scheduler", "scheduler", True),
    ("gateway", "prefill", "prefill", True),
    ("gateway", "decode", "decode", True),
    ("gateway", "aggregated", "aggregated", True),
    ("gateway", "kvstore", "kvstore", False),
    ("gateway", "kvstore", "kvstore-side", False),
    ("gateway", "decode", "decode-side", False),
    ("gateway", "prefill", "admin", False),
    ("prefill", "kvstore", "kvstore", True),
    ("prefill", "kvstore", "kvstore-side", True),
    ("decode", "kvstore", "kvstore", True),
    ("aggregated", "kvstore", "kvstore-side", True),
    ("kvstore", "kvstore", "kvstore-side", True),
    ("prefill", "decode", "decode", True),
    ("prefill", "decode", "decode-side", True),
    ("aggregated", "decode", "decode-side", True),
    ("prefill", "scheduler", "scheduler", True),
    ("kvstore", "scheduler", "scheduler", True),
    ("decode", "prefill", "prefill", False),
    ("scheduler", "kvstore", "kvstore", False),
    ("test", "scheduler", "scheduler", False),
    ("test", "gateway", "gateway", True),
]


@pytest.mark.parametrize(("caller", "target", "port", "admitted"), MATRIX)
def test_each_port_admits_only_its_callers(docs: list[dict[str, Any]], caller: str, target: str, port: str,
                                          admitted: bool) -> None:
    labels = pods(docs)
    assert admits(docs, labels[target], PORTS[port], source=labels[caller]) is admitted


def test_admin_ports_admit_the_monitoring_namespace_only(docs: list[dict[str, Any]]) -> None:
    labels = pods(docs)
    for component in ("scheduler", "prefill", "decode", "aggregated", "kvstore"):
        assert admits(docs, labels[component], PORTS["admin"], namespace=MONITORING), component
        assert not admits(docs, labels[component], PORTS["admin"], namespace=ELSEWHERE), component
        assert not admits(docs, labels[component], PORTS["admin"], source=labels["gateway"]), component
    assert admits(docs, labels["gateway"], PORTS["gateway"], namespace=ELSEWHERE), "the gateway is open to clients"


def test_every_pod_the_chart_runs_is_covered_by_a_policy(docs: list[dict[str, Any]]) -> None:
    """No pod left to the default (everything open): a policy selects each workload's pods."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for component, labels in pods(docs).items():
        if component == "test":
            continue
        assert any(selects(p["spec"]["podSelector"], labels) for p in policies), component
