"""Where engine pods land: the rendered nodeSelectors and affinity terms, played against model nodes.

`_Cluster` places pods the way kube-scheduler's filters treat these fields (nodeSelector, required
pod affinity with its first-pod exception, required pod anti-affinity in both directions, GPU
count); it is small on purpose and covers only the operators the chart renders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.helm.tools import EXAMPLES, by_kind, helm_template, render

H100 = {"kubernetes.io/os": "linux", "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "topology.kubernetes.io/zone": "us-east-1a"}


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        present = key in labels
        ok = {"Exists": present, "DoesNotExist": not present, "In": present and labels[key] in values,
              "NotIn": not present or labels[key] not in values}[op]
        if not ok:
            return False
    return True


@dataclass
class _Node:
    name: str
    labels: dict[str, str]
    gpus: int
    pods: list[dict[str, Any]] = field(default_factory=list)


class _Cluster:
    def __init__(self, nodes: list[_Node]) -> None:
        self.nodes = nodes

    def _pods(self) -> list[tuple[_Node, dict[str, Any]]]:
        return [(n, p) for n in self.nodes for p in n.pods]

    def fits(self, pod: dict[str, Any], node: _Node) -> bool:
        spec = pod["spec"]
        labels = pod["metadata"]["labels"]
        if any(node.labels.get(k) != v for k, v in spec.get("nodeSelector", {}).items()):
            return False
        used = sum(_gpus(p) for p in node.pods)
        if used + _gpus(pod) > node.gpus:
            return False
        affinity = spec.get("affinity", {})
        for term in affinity.get("podAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", []):
            key = term["topologyKey"]
            if key not in node.labels:
                return False
            peers = [(n, p) for n, p in self._pods() if _matches(term["labelSelector"], p["metadata"]["labels"])]
            if peers:
                if not any(n.labels.get(key) == node.labels[key] for n, _ in peers):
                    return False
            elif not _matches(term["labelSelector"], labels):
                return False  # kube-scheduler's exception is only for a pod that matches its own term
        for term in affinity.get("podAntiAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", []):
            key = term["topologyKey"]
            if key in node.labels and any(
                n.labels.get(key) == node.labels[key] and _matches(term["labelSelector"], p["metadata"]["labels"])
                for n, p in self._pods()
            ):
                return False
        # Existing pods' anti-affinity keeps the newcomer out as well.
        for n, p in self._pods():
            for term in p["spec"].get("affinity", {}).get("podAntiAffinity", {}).get(
                    "requiredDuringSchedulingIgnoredDuringExecution", []):
                key = term["topologyKey"]
                if key in node.labels and n.labels.get(key) == node.labels[key] and _matches(term["labelSelector"], labels):
                    return False
        return True

    def place(self, pod: dict[str, Any]) -> _Node | None:
        for node in self.nodes:
            if self.fits(pod, node):
                node.pods.append(pod)
                return node
        return None


def _gpus(pod: dict[str, Any]) -> int:
    return sum(int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0)) for c in pod["spec"]["containers"])


def _pods_of(deployment: dict[str, Any], count: int) -> list[dict[str, Any]]:
    template = deployment["spec"]["template"]
    return [{"metadata": template["metadata"], "spec": template["spec"]} for _ in range(count)]


def _engines(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: d for n, d in by_kind(docs, "Deployment").items() if "-prefill-" in n or "-decode-" in n}


def test_default_install_schedules_on_a_plain_h100_cluster() -> None:
    docs = render()
    engines = _engines(docs)
    cluster = _Cluster([_Node(f"h100-{i}", dict(H100), 8) for i in range(2)])
    for deployment in engines.values():
        spec = deployment["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert "nvidia.com/gpu.clique" not in str(spec)
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in str(spec["affinity"])
        (term,) = spec["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert term["podAffinityTerm"]["topologyKey"] == "topology.kubernetes.io/zone"
        for pod in _pods_of(deployment, 1):
            assert cluster.place(pod) is not None
    # A node without the GPU operator's label gets nothing.
    bare = _Cluster([_Node("cpu-0", {"kubernetes.io/os": "linux"}, 8)])
    assert all(bare.place(p) is None for d in engines.values() for p in _pods_of(d, 1))


def test_zone_pin_and_product_selector_reach_the_pod() -> None:
    docs = render("--set", "topology.groups[0].name=a", "--set", "topology.groups[0].zone=us-east-1b",
                  "--set", "prefill.nodeSelector.nvidia\\.com/gpu\\.product=NVIDIA-H200")
    spec = _engines(docs)["crescent-prefill-a"]["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H200",
                                    "topology.kubernetes.io/zone": "us-east-1b"}


def _nvl72(racks: int, trays: int) -> list[_Node]:
    return [_Node(f"r{r}-t{t}", {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.clique": f"uuid.{r}",
                                 "crescent.io/pool": "prefill" if t < trays // 2 else "decode"}, 4)
            for r in range(racks) for t in range(trays)]


def test_nvlink_domain_mode_gives_each_group_its_own_domain() -> None:
    args = ["--set", "topology.mode=nvlinkDomain", "--set", "prefill.nodeSelector.crescent\\.io/pool=prefill",
            "--set", "decode.nodeSelector.crescent\\.io/pool=decode", "--set", "prefill.gpus=4", "--set", "decode.gpus=4"]
    for i in range(3):
        args += ["--set", f"topology.groups[{i}].name=g{i}"]
    engines = _engines(render(*args))
    cluster = _Cluster(_nvl72(racks=3, trays=6))
    placed: dict[str, set[str]] = {}
    # Each group fills its rack (3 prefill + 3 decode trays); an unpinned group can never spill
    # into a rack another group holds, so all three fit, one per rack.
    for name, deployment in sorted(engines.items()):
        group = deployment["spec"]["template"]["metadata"]["labels"]["crescent.io/group"]
        for pod in _pods_of(deployment, 3):
            node = cluster.place(pod)
            assert node is not None, name
            placed.setdefault(group, set()).add(node.labels["nvidia.com/gpu.clique"])
    assert all(len(cliques) == 1 for cliques in placed.values()), placed
    assert len({c for cliques in placed.values() for c in cliques}) == 3
    # A fourth group finds no free domain: it waits instead of splitting or crowding a rack.
    extra = _Cluster(_nvl72(racks=2, trays=6))
    for pod in _pods_of(engines["crescent-prefill-g0"], 1) + _pods_of(engines["crescent-prefill-g1"], 1):
        assert extra.place(pod) is not None
    assert extra.place(_pods_of(engines["crescent-decode-g2"], 1)[0]) is None


def test_four_supernodes_pins_each_group_and_keeps_others_out() -> None:
    engines = _engines(render(values=[EXAMPLES / "four-supernodes.yaml"]))
    cliques = set()
    for name, deployment in engines.items():
        spec = deployment["spec"]["template"]["spec"]
        key = deployment["spec"]["template"]["metadata"]["labels"]["crescent.io/group-key"]
        cliques.add(spec["nodeSelector"]["nvidia.com/gpu.clique"])
        (anti,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti["topologyKey"] == "nvidia.com/gpu.clique"
        assert {"key": "crescent.io/group-key", "operator": "NotIn", "values": [key]} in anti["labelSelector"]["matchExpressions"]
        # The group's own pods are not repelled; every other engine pod is.
        assert not _matches(anti["labelSelector"], {"crescent.io/group-key": key})
        assert _matches(anti["labelSelector"], {"crescent.io/group-key": "other-release.rack0"})
        assert not _matches(anti["labelSelector"], {"app.kubernetes.io/component": "kvstore"})
    assert len(cliques) == 4


def test_exclusive_can_be_turned_off() -> None:
    engines = _engines(render("--set", "topology.mode=nvlinkDomain", "--set", "topology.exclusive=false"))
    for deployment in engines.values():
        assert "podAntiAffinity" not in deployment["spec"]["template"]["spec"]["affinity"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "topology.groups[0].name=a", "--set", "topology.groups[1].name=a"], 'the name "a" is used twice'),
        (["--set", "topology.groups[0].name=a", "--set", "topology.groups[0].supernode=x"], "needs topology.mode: nvlinkDomain"),
        (["--set", "topology.mode=nvlinkDomain", "--set", "topology.groups[0].name=a", "--set", "topology.groups[0].supernode=x",
          "--set", "topology.groups[1].name=b", "--set", "topology.groups[1].supernode=x"], "both pinned to nvidia.com/gpu.clique=x"),
        (["--set", "topology.mode=rack"], "mode"),
    ],
)
def test_topologies_that_cannot_schedule_are_refused(args: list[str], message: str) -> None:
    result = helm_template(*args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
