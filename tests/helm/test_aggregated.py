"""Aggregated engine groups in the chart (`aggregated.enabled`): off by default, alone or beside
the pools, pods that start `crescent serve aggregated` with settings the service loads, reachable
through the NetworkPolicy, with the certificate role the access table lets prefill and decode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from crescent.protos import scheduler_pb2
from crescent.services.aggregated.config import ENV_PREFIX, AggregatedSettings
from crescent.services.common.access import Peer, refusal
from crescent.services.common.settings import load_settings
from tests.helm.crd_schemas import schema_errors
from tests.helm.test_chart import CUSTOM_KINDS, _validate
from tests.helm.test_chart_settings import POD_FIELDS, _pod_env
from tests.helm.test_placement import H100, _Cluster, _Node, _pods_of
from tests.helm.netpol import admits
from tests.helm.tools import CHART, EXAMPLES, by_kind, helm_template, notes, render, run, tool

SMALL = EXAMPLES / "aggregated-small.yaml"
ON = ["--set", "aggregated.enabled=true"]
ALONE = [*ON, "--set", "prefill.enabled=false", "--set", "decode.enabled=false"]
TWO_GROUPS = ["--set-json", 'topology.groups=[{"name":"a"},{"name":"b"}]']
TLS = ["--set", "internalTls.certManager.enabled=true"]


def _component(doc: dict[str, Any]) -> str | None:
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def _pods(docs: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    """Pod templates of the component's Deployments."""
    return [d["spec"]["template"] for d in docs if d["kind"] == "Deployment" and _component(d) == component]


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["spec"]["containers"][0]


def test_off_by_default_renders_nothing() -> None:
    docs = render(*TLS, "--set", "monitoring.serviceMonitor.enabled=true", "--set", "aggregated.autoscaling.enabled=true",
                  "--set", "aggregated.autoscaling.keda.enabled=true")
    assert [d["metadata"]["name"] for d in docs if _component(d) == "aggregated"] == []
    opened = {p["port"] for policy in by_kind(docs, "NetworkPolicy").values()
              for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])}
    assert 50056 not in opened


def test_alone_each_group_runs_aggregated_pods_with_command_config_ports_and_certificate(tmp_path: Path) -> None:
    docs = render(*ALONE, *TWO_GROUPS, *TLS, "--set", "aggregated.replicas=3",
                  "--set", "aggregated.settings.chunk_tokens=512")
    deployments = by_kind(docs, "Deployment")
    assert sorted(n for n in deployments if "-prefill-" in n or "-decode-" in n) == []
    assert deployments["crescent-aggregated-a"]["spec"]["replicas"] == 3
    assert deployments["crescent-aggregated-b"]["spec"]["replicas"] == 3
    pod = deployments["crescent-aggregated-b"]["spec"]["template"]
    assert pod["metadata"]["labels"]["crescent.io/group"] == "b"
    container = _container(pod)
    assert container["args"] == ["aggregated", "--config", "/etc/crescent/config.yaml"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"grpc": 50056, "admin": 9090}
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1

    # The settings the pod mounts load in the service's own model, with the pod's environment.
    config = by_kind(docs, "ConfigMap")["crescent-aggregated"]["data"]["config.yaml"]
    (tmp_path / "config.yaml").write_text(config)
    settings = load_settings(AggregatedSettings, tmp_path / "config.yaml", env_prefix=ENV_PREFIX,
                             environ=_pod_env(container))
    assert (settings.listen.host, settings.listen.port, settings.listen.admin_port) == ("0.0.0.0", 50056, 9090)
    # The id discovery derives for this pod, and the address the others dial.
    assert settings.instance_id == f"aggregated-{POD_FIELDS['POD_NAME']}-50056"
    assert settings.advertise_address == f"{POD_FIELDS['POD_IP']}:50056"
    assert settings.scheduler_address == "crescent-scheduler:50051"
    assert settings.kvstore_address == "crescent-kvstore-local:50054"  # the node's kvstore, as prefill's
    assert settings.chunk_tokens == 512
    assert settings.engine.drain_grace_s == 120 - 5 - 5
    assert settings.tls.cert == "/etc/crescent-tls/tls.crt" and settings.tls.server_name == "crescent-internal"

    # Its certificate names the aggregated role, mounted where the settings look.
    cert = by_kind(docs, "Certificate")["crescent-aggregated"]
    assert cert["spec"]["uris"] == ["spiffe://crescent/aggregated"]
    assert "crescent-internal" in cert["spec"]["dnsNames"]
    tls_volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "internal-tls")
    assert tls_volume["secret"]["secretName"] == cert["spec"]["secretName"]
    assert {"name": "internal-tls", "mountPath": "/etc/crescent-tls", "readOnly": True} in container["volumeMounts"]


def test_that_certificate_may_do_what_an_aggregated_engine_does() -> None:
    """The access table (services/common/access.py) lets the chart's aggregated role register as
    one, write blocks and hand requests off, and not place requests as a gateway would."""
    peer = Peer("aggregated", "")
    info = scheduler_pb2.InstanceInfo(instance_id="aggregated-crescent-aggregated-g0-abcde-50056",
                                      role=scheduler_pb2.INSTANCE_ROLE_AGGREGATED)
    assert refusal("/crescent.v1.Scheduler/Register", peer, info) is None
    # ... and only as an aggregated instance.
    posing = scheduler_pb2.InstanceInfo(instance_id="x", role=scheduler_pb2.INSTANCE_ROLE_DECODE)
    assert refusal("/crescent.v1.Scheduler/Register", peer, posing) is not None
    for method in ("/crescent.v1.KvStore/Put", "/crescent.v1.Decode/Handoff", "/crescent.v1.Prefill/FetchPrefix",
                   "/crescent.v1.Scheduler/ListInstances"):
        assert refusal(method, peer, None) is None, method
    assert refusal("/crescent.v1.Scheduler/Place", peer, None) is not None
    # The gateway reaches an aggregated instance through the same two services as the pools'.
    for method in ("/crescent.v1.Prefill/Prefill", "/crescent.v1.Decode/StreamTokens"):
        assert refusal(method, Peer("gateway", ""), None) is None


def test_aggregated_pods_get_what_prefill_and_decode_pods_get() -> None:
    """Probes, drain, security context, volumes and placement terms: as the pools' pods."""
    docs = render(*ON, *TLS, "--set", "model.weights.source=pvc", "--set", "model.weights.pvc.existingClaim=llm")
    (aggregated,), (decode,) = _pods(docs, "aggregated"), _pods(docs, "decode")
    a, d = _container(aggregated), _container(decode)
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle", "securityContext", "resources"):
        assert a[key] == d[key], key
    assert aggregated["spec"]["securityContext"] == decode["spec"]["securityContext"]
    assert aggregated["spec"]["terminationGracePeriodSeconds"] == decode["spec"]["terminationGracePeriodSeconds"]
    assert [v["name"] for v in aggregated["spec"]["volumes"]] == [v["name"] for v in decode["spec"]["volumes"]]
    assert [m["mountPath"] for m in a["volumeMounts"]] == [m["mountPath"] for m in d["volumeMounts"]]
    assert aggregated["spec"]["nodeSelector"] == decode["spec"]["nodeSelector"]
    assert aggregated["spec"]["affinity"] == decode["spec"]["affinity"]  # the group's zone preference
    # The pool Services select only their own pods: no aggregated pod in the decode pool's endpoints.
    services = by_kind(docs, "Service")
    labels = aggregated["metadata"]["labels"]
    selecting = [n for n, s in services.items() if all(labels.get(k) == v for k, v in s["spec"]["selector"].items())]
    assert selecting == ["crescent-aggregated"]


def test_network_policy_lets_the_gateway_and_the_engines_reach_aggregated_pods() -> None:
    docs = render(*ON)
    (aggregated,) = _pods(docs, "aggregated")
    target = aggregated["metadata"]["labels"]

    def labels_of(component: str) -> dict[str, str]:
        (pod,) = [d["spec"]["template"] for d in docs if d["kind"] == "Deployment" and _component(d) == component]
        return pod["metadata"]["labels"]

    for caller in ("gateway", "prefill"):  # the gateway's calls; a peer's FetchPrefix
        assert admits(docs, target, 50056, source=labels_of(caller)), caller
    assert not admits(docs, target, 9090, source=labels_of("gateway")), "admin ports: the monitoring namespace only"
    assert admits(docs, target, 9090, namespace={"kubernetes.io/metadata.name": "monitoring"})
    # Beside the pools, every engine port stays open to the gateway.
    for component, port in (("prefill", 50052), ("decode", 50053)):
        assert admits(docs, labels_of(component), port, source=labels_of("gateway")), component


def test_beside_the_pools_each_group_has_all_three_roles_and_discovery_watches_them() -> None:
    docs = render(*ON, *TWO_GROUPS)
    deployments = by_kind(docs, "Deployment")
    for group in ("a", "b"):
        for role in ("prefill", "decode", "aggregated"):
            assert f"crescent-{role}-{group}" in deployments
    discovery = yaml.safe_load(by_kind(docs, "ConfigMap")["crescent-scheduler"]["data"]["config.yaml"])["discovery"]
    assert discovery["aggregated_service"] == "crescent-aggregated"
    assert discovery["aggregated_service"] in by_kind(docs, "Service")
    pdbs = by_kind(docs, "PodDisruptionBudget")
    assert {"crescent-aggregated-a", "crescent-aggregated-b"} <= set(pdbs)


def test_block_size_for_discovery_comes_from_aggregated_settings_too() -> None:
    docs = render(*ALONE, "--set", "aggregated.settings.engine.block_size=32")
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["crescent-scheduler"]["data"]["config.yaml"])
    assert config["discovery"]["block_size"] == 32


def test_duplicate_group_names_are_refused_with_aggregated_alone() -> None:
    result = helm_template(*ALONE, "--set-json", 'topology.groups=[{"name":"a"},{"name":"a"}]')
    assert result.returncode != 0
    assert 'the name "a" is used twice' in result.stderr


@pytest.mark.parametrize(("flag", "needle"), [
    ("aggregated.gpu=2", "'gpu' not allowed"),
    ("aggregated.autoscaling.kvUsedRatioTarget=1.5", "kvUsedRatioTarget"),
    ("aggregated.grpcPort=70000", "grpcPort"),
    ("aggregated.image.tag=latest", "image/tag"),
])
def test_schema_refuses_bad_aggregated_values(flag: str, needle: str) -> None:
    result = helm_template(*ON, "--set", flag)
    assert result.returncode != 0 and needle in result.stderr


def test_multi_node_aggregated_workers_default_to_crescents_worker() -> None:
    docs = render(*ON, "--set", "aggregated.multiNode.enabled=true")
    (lws,) = by_kind(docs, "LeaderWorkerSet").values()
    template = lws["spec"]["leaderWorkerTemplate"]
    worker = template["workerTemplate"]["spec"]["containers"][0]
    assert worker["args"] == ["aggregated-worker", "--config", "/etc/crescent/config.yaml"]
    docs = render(*ON, "--set", "aggregated.multiNode.enabled=true", "--set-json", 'aggregated.multiNode.workerArgs=["w"]')
    (lws,) = by_kind(docs, "LeaderWorkerSet").values()
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert leader["args"] == ["aggregated", "--config", "/etc/crescent/config.yaml"]
    assert worker["args"] == ["w"]  # another runtime's workers, when given


def test_small_example_lints_validates_and_scales_on_queue_and_kv(tmp_path: Path) -> None:
    result = run([tool("helm"), "lint", "--strict", str(CHART), "-f", str(SMALL)])
    assert result.returncode == 0, result.stdout + result.stderr
    rendered = helm_template(values=[SMALL])
    assert rendered.returncode == 0, rendered.stderr
    _validate(tmp_path, rendered.stdout, "1.30.0")
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    custom = [d for d in docs if d["kind"] in CUSTOM_KINDS - {"Certificate", "Issuer"}]
    assert {name: error for name, error in schema_errors(custom).items() if error} == {}
    assert {_component(d) for d in docs if d["kind"] == "Deployment"} == {"gateway", "scheduler", "aggregated"}
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "crescent-aggregated-a0"}
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]}
    assert targets == {"crescent_engine_queue_depth": "4", "crescent_engine_kv_used_ratio": "0.75"}
    assert "crescent-aggregated" in by_kind(docs, "ServiceMonitor")


def test_install_notes_name_the_aggregated_groups() -> None:
    text = notes(values=[SMALL])
    assert "aggregated: 2-6 (autoscaled) pod(s) per group x 1 GPU, each prefilling and decoding" in text
    assert "prefill:" not in text and "decode:" not in text
    assert "aggregated:" not in notes()


def test_aggregated_alone_schedules_on_a_plain_h100_cluster() -> None:
    deployments = by_kind(render(*ALONE), "Deployment")
    cluster = _Cluster([_Node("h100-0", dict(H100), 8)])
    assert all(cluster.place(pod) is not None for pod in _pods_of(deployments["crescent-aggregated-g0"], 8))
    assert cluster.place(_pods_of(deployments["crescent-aggregated-g0"], 1)[0]) is None  # 8 GPUs taken


def test_in_nvlink_domains_aggregated_pods_join_their_groups_domain_beside_the_pools() -> None:
    args = [*ON, "--set", "topology.mode=nvlinkDomain", "--set-json", 'topology.groups=[{"name":"g0"},{"name":"g1"}]']
    for role in ("prefill", "decode", "aggregated"):
        args += ["--set", f"{role}.gpus=4", "--set", f"{role}.nodeSelector.crescent\\.io/pool={role}"]
    engines = {n: d for n, d in by_kind(render(*args), "Deployment").items() if _component(d) in ("prefill", "decode", "aggregated")}
    # Two NVL72-like racks of 4-GPU trays, two trays per pool.
    cluster = _Cluster([_Node(f"r{r}-{pool}{t}", {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.clique": f"uuid.{r}",
                                                   "crescent.io/pool": pool}, 4)
                        for r in range(2) for pool in ("prefill", "decode", "aggregated") for t in range(2)])
    domains: dict[str, set[str]] = {}
    for name, deployment in sorted(engines.items()):
        group = deployment["spec"]["template"]["metadata"]["labels"]["crescent.io/group"]
        for pod in _pods_of(deployment, 2):
            node = cluster.place(pod)
            assert node is not None, name
            domains.setdefault(group, set()).add(node.labels["nvidia.com/gpu.clique"])
    assert all(len(d) == 1 for d in domains.values()) and domains["g0"] != domains["g1"], domains
