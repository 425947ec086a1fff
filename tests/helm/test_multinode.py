"""Engine instances that span nodes: one LeaderWorkerSet per group and role, chosen by
<role>.multiNode.enabled. kubernetes-validate has no schema for this custom resource (see
CUSTOM_KINDS in test_chart.py): test_crd_schemas.py checks it against the LWS CRD's schema, and
the tests here check what the LWS controller does with its fields."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helm.test_placement import _Cluster, _matches, _nvl72
from tests.helm.tools import CHART, by_kind, helm_template, render, run, tool

WORKER = ["prefill-worker", "--config", "/etc/crescent/config.yaml"]
MULTI = ["--set", "topology.mode=nvlinkDomain", "--set", "prefill.multiNode.enabled=true",
         "--set-json", f'prefill.multiNode.workerArgs={WORKER!r}'.replace("'", '"'),
         "--set", "prefill.multiNode.nodesPerInstance=3", "--set", "prefill.gpus=4", "--set", "prefill.replicas=2",
         "--set", "prefill.nodeSelector.crescent\\.io/pool=prefill"]


def _lws(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return by_kind(docs, "LeaderWorkerSet")


def test_a_multi_node_role_renders_a_leaderworkerset_instead_of_a_deployment() -> None:
    docs = render(*MULTI)
    (lws,) = _lws(docs).values()
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["name"] == "crescent-prefill-g0"
    assert "crescent-prefill-g0" not in by_kind(docs, "Deployment")
    assert "crescent-decode-g0" in by_kind(docs, "Deployment")  # the other role keeps its default
    spec = lws["spec"]
    assert spec["replicas"] == 2  # instances, not pods
    template = spec["leaderWorkerTemplate"]
    assert template["size"] == 3 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxUnavailable": 1, "maxSurge": 0}
    leader = template["leaderTemplate"]["spec"]["containers"][0]
    worker = template["workerTemplate"]["spec"]["containers"][0]
    assert leader["args"] == ["prefill", "--config", "/etc/crescent/config.yaml"]
    assert worker["args"] == WORKER
    for container in (leader, worker):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    # Only the leader registers an instance and answers probes.
    leader_env = {e["name"] for e in leader["env"]}
    worker_env = {e["name"] for e in worker["env"]}
    assert "CRESCENT_PREFILL__INSTANCE_ID" in leader_env and "CRESCENT_PREFILL__INSTANCE_ID" not in worker_env
    assert "readinessProbe" in leader and "readinessProbe" not in worker
    assert "leaderworkerset.sigs.k8s.io/exclusive-topology" not in lws["metadata"]["annotations"]


def test_only_leaders_count_as_instances() -> None:
    docs = render(*MULTI)
    (lws,) = _lws(docs).values()
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
    assert worker["app.kubernetes.io/component"] == "prefill-worker"
    service = by_kind(docs, "Service")["crescent-prefill"]
    pdb = by_kind(docs, "PodDisruptionBudget")["crescent-prefill-g0"]
    for selector in (service["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"]):
        assert _matches({"matchLabels": selector}, leader)
        assert not _matches({"matchLabels": selector}, worker)
    # Leader and workers share the group key (placement) and talk on any port inside the group.
    assert leader["crescent.io/group-key"] == worker["crescent.io/group-key"] == "crescent.g0"
    policy = by_kind(docs, "NetworkPolicy")["crescent-group-g0"]
    assert _matches(policy["spec"]["podSelector"], worker)
    assert _matches(policy["spec"]["ingress"][0]["from"][0]["podSelector"], leader)
    assert "ports" not in policy["spec"]["ingress"][0]


def test_an_instance_lands_inside_one_nvlink_domain() -> None:
    (lws,) = _lws(render(*MULTI)).values()
    template = lws["spec"]["leaderWorkerTemplate"]
    cluster = _Cluster(_nvl72(racks=2, trays=8))
    pods = [{"metadata": template["leaderTemplate"]["metadata"], "spec": template["leaderTemplate"]["spec"]}]
    pods += [{"metadata": template["workerTemplate"]["metadata"], "spec": template["workerTemplate"]["spec"]}] * 2
    nodes = [cluster.place(pod) for pod in pods]
    assert all(nodes)
    assert len({n.name for n in nodes}) == 3  # 4 GPUs per pod: one tray each
    assert len({n.labels["nvidia.com/gpu.clique"] for n in nodes}) == 1


def test_autoscalers_scale_instances_of_the_leaderworkerset() -> None:
    docs = render(*MULTI, "--set", "prefill.autoscaling.enabled=true", "--set", "monitoring.prometheusAdapter.enabled=true",
                  "--set", "decode.multiNode.enabled=true", "--set-json", 'decode.multiNode.workerArgs=["w"]',
                  "--set", "decode.autoscaling.enabled=true", "--set", "decode.autoscaling.keda.enabled=true")
    (lws_prefill,) = [d for n, d in _lws(docs).items() if "-prefill-" in n]
    assert "replicas" not in lws_prefill["spec"]
    ref = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet"}
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {**ref, "name": "crescent-prefill-g0"}
    (scaled,) = by_kind(docs, "ScaledObject").values()
    assert scaled["spec"]["scaleTargetRef"] == {**ref, "name": "crescent-decode-g0"}


def test_exclusive_topology_annotation() -> None:
    docs = render(*MULTI, "--set", "topology.mode=zone", "--set", "prefill.multiNode.exclusiveTopology=example.com/rack")
    (lws,) = _lws(docs).values()
    assert lws["metadata"]["annotations"]["leaderworkerset.sigs.k8s.io/exclusive-topology"] == "example.com/rack"


def test_workers_run_crescents_tensor_parallel_worker_by_default() -> None:
    docs = render("--set", "prefill.multiNode.enabled=true", "--set", "decode.multiNode.enabled=true",
                  "--set", "decode.multiNode.nodesPerInstance=3")
    for role, size in (("prefill", 2), ("decode", 3)):
        (lws,) = [d for n, d in _lws(docs).items() if f"-{role}-" in n]
        template = lws["spec"]["leaderWorkerTemplate"]
        assert template["size"] == size  # LWS_GROUP_SIZE: the engine's group size (engine.parallel)
        worker = template["workerTemplate"]["spec"]["containers"][0]
        leader = template["leaderTemplate"]["spec"]["containers"][0]
        # `crescent serve <role>-worker` reads the leader's config file; its rank is LWS_WORKER_INDEX.
        assert worker["args"] == [f"{role}-worker", "--config", "/etc/crescent/config.yaml"]
        assert leader["args"] == [role, "--config", "/etc/crescent/config.yaml"]
        assert worker["volumeMounts"] == leader["volumeMounts"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*MULTI, "--set", "prefill.multiNode.exclusiveTopology=nvidia.com/gpu.clique"], "group's own domain label"),
        ([*MULTI, "--set", "prefill.multiNode.nodesPerInstance=1"], "nodesPerInstance"),
    ],
)
def test_multi_node_settings_that_cannot_run_are_refused(args: list[str], message: str) -> None:
    result = helm_template(*args)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_lint_strict_with_multi_node_engines() -> None:
    result = run([tool("helm"), "lint", "--strict", str(CHART), *MULTI])
    assert result.returncode == 0, result.stdout + result.stderr
