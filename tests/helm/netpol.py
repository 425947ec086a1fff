"""Kubernetes NetworkPolicy semantics over rendered objects, for the chart's tests: whether a pod
(by its labels, in the release's namespace or another) may open a TCP connection to a port of
another pod. Ingress only (the chart renders no egress rules); ipBlock peers are not used."""

from __future__ import annotations

from typing import Any


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions) against labels; {} selects all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def admits(docs: list[dict[str, Any]], target: dict[str, str], port: int, *,
           source: dict[str, str] | None = None, namespace: dict[str, str] | None = None) -> bool:
    """Whether a pod labelled ``source`` in the release's namespace (or any pod of a namespace
    labelled ``namespace``) may reach ``port`` on a pod labelled ``target``."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy" and selects(d["spec"]["podSelector"], target)
                and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and port not in {p["port"] for p in ports}:
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                if "namespaceSelector" in peer and namespace is not None and "podSelector" not in peer \
                        and selects(peer["namespaceSelector"], namespace):
                    return True
                if "podSelector" in peer and "namespaceSelector" not in peer and source is not None \
                        and selects(peer["podSelector"], source):
                    return True
    return False
