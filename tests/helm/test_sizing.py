"""Each example fits the nodes it declares (helm/examples/node-shapes.yaml), and large weights are
fetched once per node, not once per pod."""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.tools import EXAMPLES, by_kind, helm_template, render

SHAPES = yaml.safe_load((EXAMPLES / "node-shapes.yaml").read_text())
UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _cpu(value: Any) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _gib(value: Any) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()
    return float(number) * UNITS[unit] / 2**30


def _pod_amounts(spec: dict[str, Any], field: str) -> dict[str, float]:
    """What the scheduler counts for a pod: the larger of the containers' sum and any init container."""
    def amounts(container: dict[str, Any]) -> dict[str, float]:
        r = container.get("resources", {}).get(field, {})
        return {"cpu": _cpu(r.get("cpu", 0)), "memory": _gib(r.get("memory", 0)),
                "gpus": float(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))}
    total = {"cpu": 0.0, "memory": 0.0, "gpus": 0.0}
    for container in spec["containers"]:
        for key, value in amounts(container).items():
            total[key] += value
    for container in spec.get("initContainers", []):
        for key, value in amounts(container).items():
            total[key] = max(total[key], value)
    return total


def _max_replicas(docs: list[dict[str, Any]], name: str, workload: dict[str, Any]) -> int:
    for hpa in by_kind(docs, "HorizontalPodAutoscaler").values():
        if hpa["spec"]["scaleTargetRef"]["name"] == name:
            return hpa["spec"]["maxReplicas"]
    for scaled in by_kind(docs, "ScaledObject").values():
        if scaled["spec"]["scaleTargetRef"]["name"] == name:
            return scaled["spec"]["maxReplicaCount"]
    return workload["spec"].get("replicas", 1)


def _lands_on(spec: dict[str, Any], node: dict[str, Any], pins: set[str]) -> bool:
    selector = {k: v for k, v in spec.get("nodeSelector", {}).items() if k not in pins}
    if any(node["labels"].get(k) != v for k, v in selector.items()):
        return False
    tolerated = any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", []))
    return tolerated or not node["gpuTaint"]


def _worst_node_load(example: str, node: dict[str, Any]) -> dict[str, float]:
    """The most requests and limits one node can be asked to hold, over every mix of pods that fits its GPUs."""
    values = yaml.safe_load((EXAMPLES / example).read_text())
    topology = values.get("topology", {})
    pins = {topology.get("supernodeLabel", "nvidia.com/gpu.clique"), topology.get("zoneLabel", "topology.kubernetes.io/zone")}
    docs = render(values=[EXAMPLES / example])
    fixed = [w["spec"]["template"]["spec"] for w in by_kind(docs, "DaemonSet").values()
             if _lands_on(w["spec"]["template"]["spec"], node, pins)]
    choices = [(w["spec"]["template"]["spec"], _max_replicas(docs, name, w))
               for name, w in by_kind(docs, "Deployment").items() if _lands_on(w["spec"]["template"]["spec"], node, pins)]
    # A LeaderWorkerSet's instances: a leader and size - 1 workers each.
    for name, lws in by_kind(docs, "LeaderWorkerSet").items():
        template, instances = lws["spec"]["leaderWorkerTemplate"], _max_replicas(docs, name, lws)
        for key, per_instance in (("leaderTemplate", 1), ("workerTemplate", template["size"] - 1)):
            if _lands_on(template[key]["spec"], node, pins):
                choices.append((template[key]["spec"], instances * per_instance))
    worst = {"cpu": 0.0, "memory": 0.0, "memory_limit": 0.0}
    for counts in itertools.product(*(range(n + 1) for _, n in choices)):
        mix = fixed + [spec for (spec, _), count in zip(choices, counts) for _ in range(count)]
        requests = [_pod_amounts(spec, "requests") for spec in mix]
        if sum(r["gpus"] for r in requests) > node["gpus"]:
            continue
        limits = [_pod_amounts(spec, "limits") for spec in mix]
        worst["cpu"] = max(worst["cpu"], sum(r["cpu"] for r in requests))
        worst["memory"] = max(worst["memory"], sum(r["memory"] for r in requests))
        worst["memory_limit"] = max(worst["memory_limit"], sum(max(l["memory"], r["memory"]) for l, r in zip(limits, requests)))
    return worst


@pytest.mark.parametrize("example", sorted(SHAPES))
def test_pods_an_example_puts_on_a_node_fit_it(example: str) -> None:
    for node in SHAPES[example]["nodes"]:
        load = _worst_node_load(example, node)
        assert load["memory"] > 0, f"{example}: no pod lands on {node}"
        assert load["cpu"] <= node["cpu"], (example, node["labels"], load)
        assert load["memory"] <= node["memoryGiB"], (example, node["labels"], load)
        # Limits too: memory limits past the node would let the kernel's OOM killer pick a pod.
        assert load["memory_limit"] <= node["memoryGiB"], (example, node["labels"], load)


def test_four_supernodes_tray_holds_one_engine_and_the_kvstore() -> None:
    node = SHAPES["four-supernodes.yaml"]["nodes"][0]
    load = _worst_node_load("four-supernodes.yaml", node)
    assert load["memory"] == pytest.approx(256 + 386)
    assert load["memory_limit"] == pytest.approx(384 + 386)


def test_four_supernodes_fetches_weights_once_per_node() -> None:
    docs = render(values=[EXAMPLES / "four-supernodes.yaml"])
    for name, workload in by_kind(docs, "Deployment").items():
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        if "-prefill-" in name or "-decode-" in name:
            assert volumes["weights"]["hostPath"]["path"] == "/mnt/local-nvme/crescent-weights"
        # No pod keeps a large emptyDir of its own.
        for volume in volumes.values():
            if "emptyDir" in volume and volume["emptyDir"].get("medium") != "Memory":
                assert _gib(volume["emptyDir"].get("sizeLimit", "0")) <= 1, (name, volume)


def _fetch_command(docs: list[dict[str, Any]]) -> list[str]:
    spec = by_kind(docs, "Deployment")["crescent-prefill-g0"]["spec"]["template"]["spec"]
    (fetch,) = [c for c in spec["initContainers"] if c["name"] == "fetch-weights"]
    return fetch["command"]


def test_node_cache_fetch_runs_once_then_skips(tmp_path: Path) -> None:
    """The rendered init command, run twice in a shell against a directory: one download."""
    cache = tmp_path / "models"
    cache.mkdir()
    log = tmp_path / "fetches"
    script = f"echo fetched >> {log}; mkdir -p {cache}/M && echo w > {cache}/M/model.safetensors"
    docs = render("--set", "model.weights.source=hostPath", "--set", "model.weights.path=M",
                  "--set-json", f"model.weights.init.command={['sh', '-c', script]!r}".replace("'", '"'),
                  "--set", f"model.weights.mountPath={cache}")
    command = _fetch_command(docs)
    for _ in range(2):
        subprocess.run(command, check=True, timeout=30, capture_output=True)
    assert log.read_text() == "fetched\n"
    assert (cache / "M" / "model.safetensors").exists()
    # A failed fetch leaves no marker: the next pod tries again.
    broken = tmp_path / "broken"
    broken.mkdir()
    docs = render("--set", "model.weights.source=hostPath", "--set-json", 'model.weights.init.command=["false"]',
                  "--set", f"model.weights.mountPath={broken}")
    assert subprocess.run(_fetch_command(docs), timeout=30).returncode != 0
    assert list(broken.iterdir()) == []


def test_the_fetch_marker_changes_with_the_command() -> None:
    first = _fetch_command(render("--set", "model.weights.source=hostPath", "--set-json", 'model.weights.init.command=["a"]'))
    assert "model.weights.init.command" in helm_template("--set", "model.weights.source=hostPath").stderr
    second = _fetch_command(render("--set", "model.weights.source=hostPath", "--set-json", 'model.weights.init.command=["b"]'))
    assert first[3] != second[3]
