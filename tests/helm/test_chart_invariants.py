"""What the chart promises operators, checked on the rendered manifests."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from tests.helm.tools import CHART, EXAMPLES, by_kind, helm_template, render

COMPONENTS = ("gateway", "scheduler", "prefill", "decode", "aggregated", "kvstore")


def _pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    return _pod_spec(workload)["containers"][0]


def _gpus(workload: dict[str, Any]) -> int:
    return int(_container(workload)["resources"].get("limits", {}).get("nvidia.com/gpu", 0))


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _label_selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """matchLabels plus the matchExpressions operators the chart uses."""
    for expr in selector.get("matchExpressions", []):
        if expr["operator"] == "DoesNotExist" and expr["key"] in labels:
            return False
        if expr["operator"] == "Exists" and expr["key"] not in labels:
            return False
    return _selects(selector.get("matchLabels", {}), labels)


def test_one_supernode_puts_eight_gpus_on_its_engines() -> None:
    docs = render(values=[EXAMPLES / "one-supernode-8gpu.yaml"])
    deployments = by_kind(docs, "Deployment")
    # Qwen3-32B on vLLM: 4 aggregated pods, tensor parallel 2 (the native engine cannot load it).
    aggregated = deployments["crescent-aggregated-sn0"]
    assert (aggregated["spec"]["replicas"], _gpus(aggregated)) == (4, 2)
    assert "crescent-prefill-sn0" not in deployments and "crescent-decode-sn0" not in deployments
    assert sum(d["spec"]["replicas"] * _gpus(d) for d in deployments.values()) == 8
    for workload in (aggregated,):
        spec = _pod_spec(workload)
        assert spec["nodeSelector"] == {
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "crescent.io/supernode": "sn0",
        }
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
    # Only the engines ask for GPUs.
    for name, workload in deployments.items():
        if "-aggregated-" not in name:
            assert _gpus(workload) == 0, name


def test_four_supernodes_keep_each_group_inside_one_nvlink_domain() -> None:
    docs = render(values=[EXAMPLES / "four-supernodes.yaml"])
    deployments = by_kind(docs, "Deployment")
    cliques = {group["name"]: group["supernode"] for group in yaml.safe_load((EXAMPLES / "four-supernodes.yaml").read_text())["topology"]["groups"]}
    assert len(set(cliques.values())) == 4  # each group pinned to its own rack
    for group in ("rack0", "rack1", "rack2", "rack3"):
        for role, pool in (("prefill", "prefill"), ("decode", "decode")):
            workload = deployments[f"crescent-{role}-{group}"]
            spec = _pod_spec(workload)
            assert _gpus(workload) == 4
            assert spec["nodeSelector"] == {"crescent.io/pool": pool, "nvidia.com/gpu.present": "true",
                                            "nvidia.com/gpu.clique": cliques[group]}
            (term,) = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert term["topologyKey"] == "nvidia.com/gpu.clique"
            pod_labels = workload["spec"]["template"]["metadata"]["labels"]
            # The term selects the pod itself and its group's pods of the other role, nothing else.
            assert _selects(term["labelSelector"]["matchLabels"], pod_labels)
            assert term["labelSelector"]["matchLabels"]["crescent.io/group-key"] == f"crescent.{group}"
            # The autoscalers own the replica count.
            assert "replicas" not in workload["spec"]
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    scaled = by_kind(docs, "ScaledObject")
    assert sorted(hpas) == [f"crescent-prefill-rack{i}" for i in range(4)]
    assert sorted(scaled) == [f"crescent-decode-rack{i}" for i in range(4)]
    for hpa in hpas.values():
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "crescent_engine_queue_depth"
    for obj in scaled.values():
        assert obj["spec"]["scaleTargetRef"]["name"] in deployments
        queries = [t["metadata"]["query"] for t in obj["spec"]["triggers"]]
        # The TBT trigger reads the group's own decode steps, not the whole namespace's latency.
        group = obj["metadata"]["labels"]["crescent.io/group"]
        assert any("crescent_engine_step_seconds_bucket" in q and f'pod=~"crescent-decode-{group}-' in q
                   for q in queries)
        # The TBT trigger aims at 80% of the 0.05s SLO.
        assert any(t["metadata"]["threshold"] == "0.04" for t in obj["spec"]["triggers"])


def test_kvstore_runs_on_gpu_nodes_with_host_memory_and_local_ssd() -> None:
    docs = render(values=[EXAMPLES / "one-supernode-8gpu.yaml"])
    daemonset = by_kind(docs, "DaemonSet")["crescent-kvstore"]
    spec = _pod_spec(daemonset)
    # The example adds its supernode to the default GPU-node selector.
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true", "crescent.io/supernode": "sn0"}
    ssd = next(v for v in spec["volumes"] if v["name"] == "ssd")
    assert ssd["hostPath"]["path"] == "/mnt/nvme0/crescent-kv"
    assert _container(daemonset)["resources"]["limits"]["memory"] == "514Gi"
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["crescent-kvstore"]["data"]["config.yaml"])
    assert config["tiers"]["host"]["capacity_bytes"] == 512 * 1024**3
    assert config["tiers"]["disk"] == {"enabled": True, "path": "/var/lib/crescent/kv", "capacity_bytes": 3000 * 1024**3}
    assert config["tiers"]["s3"]["bucket"] == "crescent-kv-prod"
    # Engines find their node's kvstore through a node-local Service.
    local = by_kind(docs, "Service")["crescent-kvstore-local"]
    assert local["spec"]["internalTrafficPolicy"] == "Local"
    engine_config = yaml.safe_load(by_kind(docs, "ConfigMap")["crescent-aggregated"]["data"]["config.yaml"])
    assert engine_config["kvstore_address"] == "crescent-kvstore-local:50054"


def test_cpu_dev_install_asks_for_no_gpu_and_runs_a_kvstore_on_every_node() -> None:
    docs = render(values=[EXAMPLES / "cpu-dev.yaml"])
    workloads = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]
    assert workloads and all(_gpus(w) == 0 for w in workloads)
    assert all("tolerations" not in _pod_spec(w) for w in workloads)
    assert "nodeSelector" not in _pod_spec(by_kind(docs, "DaemonSet")["crescent-kvstore"])
    assert all(w["spec"].get("replicas", 1) == 1 for w in workloads if w["kind"] == "Deployment")


@pytest.mark.parametrize("example", ["one-supernode-8gpu.yaml", "four-supernodes.yaml"])
def test_secrets_are_referenced_never_inlined(example: str) -> None:
    docs = render(values=[EXAMPLES / example])
    # The only Secrets the chart makes hold what it generates itself: the internal TLS CA and
    # certificates (internalTls.selfSigned). Credentials it is given stay in Secrets it names.
    for name, secret in by_kind(docs, "Secret").items():
        assert name == "crescent-internal-ca" or re.fullmatch(r"crescent-[a-z]+-tls", name), name
        assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"ca.crt", "tls.crt", "tls.key"}, name
    values = yaml.safe_load((EXAMPLES / example).read_text())
    s3 = values["kvstore"]["s3"]
    env = {e["name"]: e for e in _container(by_kind(docs, "DaemonSet")["crescent-kvstore"])["env"]}
    for name, key in (("AWS_ACCESS_KEY_ID", "accessKeyIdKey"), ("AWS_SECRET_ACCESS_KEY", "secretAccessKeyKey")):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": s3["existingSecret"], "key": s3.get(key, name)}
        assert "value" not in env[name]
    for config_map in by_kind(docs, "ConfigMap").values():
        text = config_map["data"].get("config.yaml", "")
        assert not re.search(r"access_key|secret_access|password", text, re.IGNORECASE), config_map["metadata"]["name"]


def test_s3_needs_an_existing_secret_and_refuses_inline_credentials() -> None:
    missing = helm_template("--set", "kvstore.s3.enabled=true", "--set", "kvstore.s3.bucket=kv")
    assert missing.returncode != 0 and "kvstore.s3.existingSecret" in missing.stderr
    inline = helm_template("--set", "kvstore.settings.tiers.s3.secret_access_key=hunter2")
    assert inline.returncode != 0 and "must not hold S3 credentials" in inline.stderr
    # There is no values key for a credential: the schema rejects one.
    typo = helm_template("--set", "kvstore.s3.secretAccessKey=hunter2")
    assert typo.returncode != 0 and "secretAccessKey" in typo.stderr


@pytest.mark.parametrize(
    ("flag", "bad_key"),
    [
        ("gateway.replica=3", "replica"),
        ("prefill.gpu=2", "gpu"),
        ("monitoring.serviceMonitor.enable=true", "enable"),
        ("topology.groups[0].supernod=sn0", "supernod"),
    ],
)
def test_schema_rejects_misspelt_keys(flag: str, bad_key: str) -> None:
    result = helm_template("--set", flag)
    assert result.returncode != 0
    assert f"'{bad_key}' not allowed" in result.stderr


def test_schema_rejects_unpinned_tags_and_slos_off_the_histogram_buckets() -> None:
    assert "image/tag" in helm_template("--set", "gateway.image.tag=latest").stderr
    assert "ttftSeconds" in helm_template("--set-json", "slo.ttftSeconds=2.5").stderr
    assert helm_template("--set-json", "slo.ttftSeconds=1.5").returncode == 0


def _component_of(doc: dict[str, Any]) -> str | None:
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")


@pytest.mark.parametrize("component", COMPONENTS)
def test_disabled_component_renders_nothing(component: str) -> None:
    everything = ["--set", "monitoring.serviceMonitor.enabled=true", "--set", "gateway.ingress.enabled=true",
                  "--set", "prefill.autoscaling.enabled=true", "--set", "decode.autoscaling.enabled=true",
                  "--set", "monitoring.prometheusAdapter.enabled=true", "--set", "aggregated.enabled=true",
                  "--set", "aggregated.autoscaling.enabled=true"]
    before = [d for d in render(*everything) if _component_of(d) == component]
    after = render(*everything, "--set", f"{component}.enabled=false")
    assert before, f"{component} renders nothing even when enabled"
    assert [d["metadata"]["name"] for d in after if _component_of(d) == component] == []


def test_everything_disabled_renders_only_release_plumbing() -> None:
    args = [arg for c in COMPONENTS for arg in ("--set", f"{c}.enabled=false")]
    kinds = sorted(d["kind"] for d in render(*args, "--set", "networkPolicy.enabled=false"))
    assert kinds == ["ServiceAccount"]


def test_scheduler_is_a_single_replica_recreated_on_update() -> None:
    scheduler = by_kind(render(), "Deployment")["crescent-scheduler"]
    assert scheduler["spec"]["replicas"] == 1
    assert scheduler["spec"]["strategy"] == {"type": "Recreate"}
    assert _pod_spec(scheduler)["automountServiceAccountToken"] is True
    role = by_kind(render(), "Role")["crescent-scheduler"]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]


def test_grpc_ports_admit_only_the_release_pods() -> None:
    """Every gRPC port's rule names pods of this release only; the gateway's port is the one open to all."""
    docs = render()
    release = {"app.kubernetes.io/name": "crescent", "app.kubernetes.io/instance": "crescent"}
    workloads = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]
    grpc_ports = {int(p["containerPort"]) for w in workloads for p in _container(w)["ports"] if p["name"] == "grpc"}
    assert grpc_ports == {50051, 50052, 50053, 50054}
    open_ports = []
    for policy in by_kind(docs, "NetworkPolicy").values():
        for rule in policy["spec"]["ingress"]:
            ports = {p["port"] for p in rule["ports"]}
            if "from" not in rule:
                open_ports.append(ports)
            elif ports & grpc_ports:
                assert all(peer["podSelector"]["matchLabels"] == release for peer in rule["from"])
    assert open_ports == [{8000}]


@pytest.mark.parametrize("example", ["cpu-dev.yaml", "one-supernode-8gpu.yaml", "four-supernodes.yaml"])
def test_every_selector_finds_its_pods(example: str) -> None:
    docs = render(values=[EXAMPLES / example])
    pods = [w["spec"]["template"]["metadata"]["labels"] for w in docs if w["kind"] in ("Deployment", "DaemonSet")]
    for service in by_kind(docs, "Service").values():
        assert any(_selects(service["spec"]["selector"], labels) for labels in pods), service["metadata"]["name"]
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        assert any(_selects(pdb["spec"]["selector"]["matchLabels"], labels) for labels in pods), pdb["metadata"]["name"]
    for monitor in by_kind(docs, "ServiceMonitor").values():
        selector = monitor["spec"]["selector"]
        services = [s for s in by_kind(docs, "Service").values() if _label_selector_matches(selector, s["metadata"]["labels"])]
        # Exactly one Service per ServiceMonitor, with the port it scrapes: two would scrape
        # every pod twice and double every sum on the dashboards.
        assert len(services) == 1, (monitor["metadata"]["name"], [s["metadata"]["name"] for s in services])
        port = monitor["spec"]["endpoints"][0]["port"]
        assert port in {p["name"] for p in services[0]["spec"]["ports"]}


def test_dashboards_ship_the_committed_json() -> None:
    docs = render("--set", "monitoring.dashboards.enabled=true")
    maps = {n: d for n, d in by_kind(docs, "ConfigMap").items() if "-dashboard-" in n}
    assert sorted(maps) == ["crescent-dashboard-cache", "crescent-dashboard-overview", "crescent-dashboard-pools"]
    for name, config_map in maps.items():
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        short = name.rsplit("-", 1)[-1]
        shipped = json.loads(config_map["data"][f"crescent-{short}.json"])
        assert shipped == json.loads((CHART / "dashboards" / f"{short}.json").read_text())
