"""Upgrades that roll on full GPU nodes, and node drains no budget can stall.

A rollout's surge pods need GPUs beyond what the group holds. On nodes packed with engine pods
(helm/examples/node-shapes.yaml: each node filled with as many of a pool's pods as its GPUs
take) the only free GPUs are the remainder, so the GPUs maxSurge asks for must fit in it; a
Deployment without a strategy gets Kubernetes' default of 25% surge, which never does.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import yaml

from tests.helm.test_sizing import SHAPES, _lands_on, _max_replicas, _pod_amounts
from tests.helm.tools import EXAMPLES, by_kind, helm_template, render

# Kubernetes' defaults for a Deployment that names no strategy.
DEFAULT_ROLLING_UPDATE = {"maxSurge": "25%", "maxUnavailable": "25%"}


def _count(value: int | str, replicas: int, *, round_up: bool) -> int:
    """An IntOrString as Kubernetes resolves it: surge percentages round up, unavailable down."""
    if isinstance(value, int):
        return value
    share = int(value.rstrip("%")) * replicas / 100
    return math.ceil(share) if round_up else math.floor(share)


def _rollouts(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], list[dict[str, Any]], int, dict[str, Any]]]:
    """(name, rolling update, pod specs of one replica, replicas at the most, workload) per GPU workload."""
    found = []
    for name, deployment in by_kind(docs, "Deployment").items():
        spec = deployment["spec"]["template"]["spec"]
        if _pod_amounts(spec, "limits")["gpus"] == 0:
            continue
        strategy = deployment["spec"].get("strategy", {"type": "RollingUpdate"})
        assert strategy["type"] == "RollingUpdate", name  # Recreate would take the whole group down
        rolling = {**DEFAULT_ROLLING_UPDATE, **strategy.get("rollingUpdate", {})}
        found.append((name, rolling, [spec], _max_replicas(docs, name, deployment), deployment))
    for name, lws in by_kind(docs, "LeaderWorkerSet").items():
        template = lws["spec"]["leaderWorkerTemplate"]
        specs = [template["leaderTemplate"]["spec"]] + [template["workerTemplate"]["spec"]] * (template["size"] - 1)
        rolling = lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]
        found.append((name, rolling, specs, _max_replicas(docs, name, lws), lws))
    return found


def surge_problems(example: str, *args: str) -> list[str]:
    """Workloads of ``example`` whose rollout needs more GPUs than a packed node has free."""
    return _problems(example, render(*args, values=[EXAMPLES / example]))


def _problems(example: str, docs: list[dict[str, Any]]) -> list[str]:
    values = yaml.safe_load((EXAMPLES / example).read_text())
    topology = values.get("topology", {})
    pins = {topology.get("supernodeLabel", "nvidia.com/gpu.clique"), topology.get("zoneLabel", "topology.kubernetes.io/zone")}
    problems = []
    for name, rolling, specs, replicas, _ in _rollouts(docs):
        surge = _count(rolling["maxSurge"], replicas, round_up=True)
        unavailable = _count(rolling["maxUnavailable"], replicas, round_up=False)
        if surge == 0 and unavailable == 0:
            problems.append(f"{name}: maxSurge and maxUnavailable are both 0: the rollout never progresses")
        for spec in specs:
            gpus = int(_pod_amounts(spec, "limits")["gpus"])
            for node in SHAPES[example]["nodes"]:
                if not _lands_on(spec, node, pins):
                    continue
                free = node["gpus"] % gpus  # what a node full of this pool's pods has left
                if surge * gpus > free:
                    problems.append(f"{name}: {surge} surge pod(s) x {gpus} GPUs, {free} free on a packed {node['gpus']}-GPU node")
    return problems


GPU_EXAMPLES = sorted(e for e, shape in SHAPES.items() if any(n["gpus"] for n in shape["nodes"]))


@pytest.mark.parametrize("example", GPU_EXAMPLES)
def test_an_upgrade_rolls_on_packed_gpu_nodes(example: str) -> None:
    assert _rollouts(render(values=[EXAMPLES / example])), f"{example} has no GPU workload to check"
    assert surge_problems(example) == []


def test_the_check_catches_a_surge_or_the_kubernetes_default() -> None:
    """What the check guards against: a surge pod on 4-GPU trays full of 4-GPU pods."""
    assert surge_problems("four-supernodes.yaml", "--set", "decode.rollingUpdate.maxSurge=1")
    assert surge_problems("four-supernodes.yaml", "--set", "prefill.rollingUpdate.maxSurge=25%")
    # The Deployments as the chart rendered them before: no strategy, so Kubernetes' 25% surge.
    docs = render(values=[EXAMPLES / "four-supernodes.yaml"])
    for deployment in by_kind(docs, "Deployment").values():
        deployment["spec"].pop("strategy", None)
    assert len(_problems("four-supernodes.yaml", docs)) == 8  # prefill and decode of each of the 4 racks


@pytest.mark.parametrize("role", ["prefill", "decode", "aggregated"])
def test_every_gpu_engine_deployment_has_no_surge_by_default(role: str) -> None:
    docs = render("--set", "aggregated.enabled=true")
    deployment = by_kind(docs, "Deployment")[f"crescent-{role}-g0"]
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


@pytest.mark.parametrize("role", ["prefill", "decode", "aggregated"])
def test_rolling_update_is_a_knob_per_pool_and_shared_with_leaderworkerset(role: str) -> None:
    on = ["--set", "aggregated.enabled=true", "--set", f"{role}.rollingUpdate.maxUnavailable=25%",
          "--set", f"{role}.rollingUpdate.maxSurge=1"]
    deployment = by_kind(render(*on), "Deployment")[f"crescent-{role}-g0"]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": "25%"}
    lws = by_kind(render(*on, "--set", f"{role}.multiNode.enabled=true"), "LeaderWorkerSet")[f"crescent-{role}-g0"]
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxSurge": 1, "maxUnavailable": "25%"}
    # The other pools keep their default.
    other = "decode" if role == "prefill" else "prefill"
    assert by_kind(render(*on), "Deployment")[f"crescent-{other}-g0"]["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def test_a_rollout_that_could_never_progress_is_refused() -> None:
    result = helm_template("--set", "decode.rollingUpdate.maxUnavailable=0")
    assert result.returncode != 0 and "decode.rollingUpdate" in result.stderr
    result = helm_template("--set", "decode.rollingUpdate.maxUnavailable=0", "--set", "decode.rollingUpdate.maxSurge=1")
    assert result.returncode == 0, result.stderr


def test_no_budget_holds_a_drain_hostage_to_an_unhealthy_pod() -> None:
    """A pod that is not Ready (crash-looping, loading weights) may always be evicted."""
    docs = render("--set", "aggregated.enabled=true", "--set", "gateway.replicas=2",
                  "--set", "gateway.database.type=postgresql", "--set", "gateway.database.postgresql.existingSecret=pg",
                  "--set", "gateway.limits.store=redis", "--set", "gateway.limits.redis.existingSecret=redis")
    budgets = by_kind(docs, "PodDisruptionBudget")
    assert set(budgets) == {"crescent-gateway", "crescent-prefill-g0", "crescent-decode-g0", "crescent-aggregated-g0"}
    for name, budget in budgets.items():
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow", name
