"""Pod Security: the level each workload declares, checked against the restricted profile's rules;
the kvstore's modes (node directory with a CHOWN init, prepared directory, ephemeral volume with
fsGroup), huge pages and its update strategy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.test_chart import _validate
from tests.helm.tools import EXAMPLES, by_kind, helm_template, notes, render

LEVEL = "crescent.io/pod-security-level"
WEIGHTS_ON_NODE = ["--set", "model.weights.source=hostPath", "--set-json", 'model.weights.init.command=["fetch"]']
# Volume types the restricted (and baseline) profile admits.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}


def _workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "DaemonSet", "LeaderWorkerSet")]


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    if workload["kind"] == "LeaderWorkerSet":
        return workload["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    return workload["spec"]["template"]["spec"]


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What in a pod spec the restricted Pod Security Standard (v1.30+) forbids."""
    problems = []
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"volume {volume['name']}: {sorted(kinds)}")
    pod_sc = pod.get("securityContext", {})
    for container in pod.get("initContainers", []) + pod["containers"]:
        sc = container.get("securityContext", {})
        name = container["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: capabilities {caps}")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) or sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            problems.append(f"{name}: may run as root")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccomp")
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
    return problems


@pytest.mark.parametrize("args", [[], ["--set", "kvstore.ssd.volume=ephemeral"], WEIGHTS_ON_NODE,
                                  ["--set", "hostPaths.ownership=prepared"]])
def test_every_workload_declares_the_level_it_needs(args: list[str]) -> None:
    for workload in _workloads(render(*args)):
        level = workload["metadata"]["annotations"][LEVEL]
        violations = restricted_violations(_pod(workload))
        if level == "restricted":
            assert violations == [], (workload["metadata"]["name"], violations)
        else:
            assert level == "privileged" and violations, workload["metadata"]["name"]


def test_default_kvstore_needs_privileged_and_the_notes_say_so() -> None:
    daemonset = by_kind(render(), "DaemonSet")["crescent-kvstore"]
    assert daemonset["metadata"]["annotations"][LEVEL] == "privileged"
    (init,) = _pod(daemonset)["initContainers"]
    assert init["securityContext"]["runAsUser"] == 0
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    text = notes()
    assert "kubectl label namespace serving pod-security.kubernetes.io/enforce=privileged" in text
    assert "kvstore.ssd.hostPath" in text


def test_prepared_directories_need_no_root_container() -> None:
    docs = render("--set", "hostPaths.ownership=prepared", *WEIGHTS_ON_NODE)
    for workload in _workloads(docs):
        for container in _pod(workload).get("initContainers", []):
            assert container["securityContext"].get("runAsUser") != 0, workload["metadata"]["name"]
        for volume in _pod(workload).get("volumes", []):
            if "hostPath" in volume:
                assert volume["hostPath"]["type"] == "Directory"
    assert "root init container" not in notes("--set", "hostPaths.ownership=prepared")


def test_ephemeral_ssd_runs_at_the_restricted_level() -> None:
    args = ["--set", "kvstore.ssd.volume=ephemeral", "--set", "kvstore.ssd.storageClassName=local-nvme",
            "--set", "kvstore.ssd.capacityGiB=3000"]
    docs = render(*args)
    daemonset = by_kind(docs, "DaemonSet")["crescent-kvstore"]
    pod = _pod(daemonset)
    assert daemonset["metadata"]["annotations"][LEVEL] == "restricted"
    assert "initContainers" not in pod
    assert pod["securityContext"]["fsGroup"] == 10001  # what makes the fresh volume writable
    (ssd,) = [v for v in pod["volumes"] if v["name"] == "ssd"]
    claim = ssd["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "local-nvme" and claim["resources"]["requests"]["storage"] == "3000Gi"
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["crescent-kvstore"]["data"]["config.yaml"])
    assert config["tiers"]["disk"]["capacity_bytes"] == 3000 * 2**30
    assert "pod-security.kubernetes.io/enforce=restricted" in notes(*args)


@pytest.mark.parametrize("size", ["2Mi", "1Gi"])
def test_hugepages_are_reserved_and_mounted(size: str) -> None:
    docs = render("--set", "kvstore.hugepages.enabled=true", "--set", f"kvstore.hugepages.pageSize={size}",
                  "--set", "kvstore.hugepages.sizeGiB=64")
    pod = _pod(by_kind(docs, "DaemonSet")["crescent-kvstore"])
    resources = pod["containers"][0]["resources"]
    assert resources["requests"][f"hugepages-{size}"] == resources["limits"][f"hugepages-{size}"] == "64Gi"
    assert resources["requests"]["memory"] == "2Gi"  # the host tier's pool is in the huge pages, not here
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["crescent-kvstore"]["data"]["config.yaml"])
    assert config["tiers"]["host"]["huge_pages"] == size and config["tiers"]["host"]["capacity_bytes"] == 64 * 2**30
    (volume,) = [v for v in pod["volumes"] if v["name"] == "hugepages"]
    assert volume["emptyDir"]["medium"] == f"HugePages-{size}"
    assert {"name": "hugepages", "mountPath": "/dev/hugepages"} in pod["containers"][0]["volumeMounts"]
    assert helm_template("--set", "kvstore.hugepages.pageSize=4Mi").returncode != 0
    too_few = helm_template("--set", "kvstore.hugepages.enabled=true", "--set", "kvstore.hugepages.sizeGiB=32")
    assert too_few.returncode != 0 and "must hold kvstore.hostMemoryGiB (64)" in too_few.stderr
    default = _pod(by_kind(render("--set", "kvstore.hugepages.enabled=true"), "DaemonSet")["crescent-kvstore"])
    assert default["containers"][0]["resources"]["limits"]["hugepages-2Mi"] == "64Gi"  # sizeGiB 0: hostMemoryGiB


def test_update_strategy_choice() -> None:
    rolling = by_kind(render("--set", "kvstore.updateStrategy.maxUnavailable=2"), "DaemonSet")["crescent-kvstore"]
    assert rolling["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 2}}
    on_delete = by_kind(render("--set", "kvstore.updateStrategy.type=OnDelete"), "DaemonSet")["crescent-kvstore"]
    assert on_delete["spec"]["updateStrategy"] == {"type": "OnDelete"}
    # The SSD tier's directory outlives the pod; the host tier does not (docs say so).
    (ssd,) = [v for v in _pod(rolling)["volumes"] if v["name"] == "ssd"]
    assert "hostPath" in ssd


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
def test_kvstore_modes_are_valid_kubernetes(tmp_path: Path, version: str) -> None:
    for args in (["--set", "kvstore.ssd.volume=ephemeral", "--set", "kvstore.hugepages.enabled=true"],
                 ["--set", "kvstore.updateStrategy.type=OnDelete", "--set", "hostPaths.ownership=prepared", *WEIGHTS_ON_NODE]):
        result = helm_template(*args)
        assert result.returncode == 0, result.stderr
        _validate(tmp_path, result.stdout, version)


def test_four_supernodes_notes_warn_about_both_node_directories() -> None:
    text = notes(values=[EXAMPLES / "four-supernodes.yaml"])
    assert "kvstore.ssd.hostPath model.weights.hostPath" in text
