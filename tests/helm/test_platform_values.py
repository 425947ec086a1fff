"""What a platform team sets around the chart: `global` (Crescent as a subchart of an umbrella
chart), identity and load-balancer annotations, and how every pod is scheduled (priority, runtime
class, scheduler, topology spread, extra labels)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.test_chart import _validate
from tests.helm.tools import CHART, by_kind, helm_template, render, run, tool

COMPONENTS = ("gateway", "scheduler", "prefill", "decode", "aggregated", "kvstore")
GLOBAL = {"imageRegistry": "registry.corp.example", "storageClass": "fast", "team": {"name": "ml-platform"}}


def _pod_templates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod template the chart renders, by workload (a LeaderWorkerSet's leader and worker apart)."""
    found = {}
    for kind in ("Deployment", "DaemonSet"):
        for name, workload in by_kind(docs, kind).items():
            found[name] = workload["spec"]["template"]
    for name, lws in by_kind(docs, "LeaderWorkerSet").items():
        template = lws["spec"]["leaderWorkerTemplate"]
        found[f"{name}/leader"], found[f"{name}/worker"] = template["leaderTemplate"], template["workerTemplate"]
    return found


def test_global_values_are_accepted() -> None:
    """Helm hands an umbrella chart's `global` to every subchart; the strict schema takes any object."""
    assert helm_template("--set-json", f"global={json.dumps(GLOBAL)}").returncode == 0
    assert helm_template("--set", "globl.x=1").returncode != 0, "a misspelt top-level key is still refused"


def test_an_umbrella_chart_with_crescent_as_a_dependency_renders(tmp_path: Path) -> None:
    umbrella = tmp_path / "platform"
    (umbrella / "templates").mkdir(parents=True)
    (umbrella / "templates" / "NOTES.txt").write_text("The platform.\n")
    (umbrella / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0", "icon": "https://example.com/icon.png",
        "dependencies": [{"name": "crescent", "version": "0.1.0", "repository": f"file://{CHART}"}]}))
    (umbrella / "values.yaml").write_text(yaml.safe_dump({
        "global": GLOBAL,
        "crescent": {"gateway": {"httpRoute": {"enabled": True, "parentRefs": [{"name": "public", "namespace": "gateways"}]}},
                     "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/crescent"}}}}))
    helm_home = {f"HELM_{d}_HOME": str(tmp_path / d.lower()) for d in ("CONFIG", "CACHE", "DATA")}
    env = {**os.environ, **helm_home}
    built = run([tool("helm"), "dependency", "build", str(umbrella)], env=env)
    assert built.returncode == 0, built.stdout + built.stderr
    assert [p.name for p in (umbrella / "charts").iterdir()] == ["crescent-0.1.0.tgz"]
    lint = run([tool("helm"), "lint", "--strict", str(umbrella)], env=env)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    result = run([tool("helm"), "template", "llm", str(umbrella), "--namespace", "serving"], env=env)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert {"llm-crescent-gateway", "llm-crescent-scheduler"} <= set(by_kind(docs, "Deployment"))
    assert by_kind(docs, "HTTPRoute")["llm-crescent-gateway"]["spec"]["parentRefs"][0]["name"] == "public"
    assert by_kind(docs, "ServiceAccount")["llm-crescent"]["metadata"]["annotations"] == {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/crescent"}
    _validate(tmp_path, result.stdout, "1.30.0")


def test_a_chart_copied_into_charts_renders_with_global_too(tmp_path: Path) -> None:
    umbrella = tmp_path / "platform"
    shutil.copytree(CHART, umbrella / "charts" / "crescent")
    (umbrella / "Chart.yaml").write_text(yaml.safe_dump({"apiVersion": "v2", "name": "platform", "version": "1.0.0"}))
    (umbrella / "values.yaml").write_text(yaml.safe_dump({"global": GLOBAL}))
    result = run([tool("helm"), "template", "llm", str(umbrella), "--namespace", "serving"])
    assert result.returncode == 0, result.stderr


def test_service_account_and_service_annotations() -> None:
    args = ["--set", "aggregated.enabled=true",
            "--set-json", 'serviceAccount.annotations={"iam.gke.io/gcp-service-account":"kv@p.iam.gserviceaccount.com"}']
    for component in COMPONENTS:
        args += ["--set-json", f'{component}.service.annotations={{"example.com/owner":"{component}"}}']
    docs = render(*args)
    (account,) = by_kind(docs, "ServiceAccount").values()
    assert account["metadata"]["annotations"] == {"iam.gke.io/gcp-service-account": "kv@p.iam.gserviceaccount.com"}
    services = by_kind(docs, "Service")
    owners = {name: s["metadata"].get("annotations", {}).get("example.com/owner") for name, s in services.items()}
    assert owners == {"crescent-gateway": "gateway", "crescent-scheduler": "scheduler", "crescent-prefill": "prefill",
                      "crescent-decode": "decode", "crescent-aggregated": "aggregated", "crescent-kvstore": "kvstore",
                      "crescent-kvstore-local": "kvstore"}
    assert all("annotations" not in s["metadata"] for s in by_kind(render(), "Service").values())


def test_the_gateways_load_balancer_class_and_source_ranges() -> None:
    knobs = ["--set", "gateway.service.loadBalancerClass=service.k8s.aws/nlb",
             "--set-json", 'gateway.service.loadBalancerSourceRanges=["10.0.0.0/8","192.0.2.0/24"]']
    service = by_kind(render("--set", "gateway.service.type=LoadBalancer", *knobs), "Service")["crescent-gateway"]
    assert service["spec"]["loadBalancerClass"] == "service.k8s.aws/nlb"
    assert service["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8", "192.0.2.0/24"]
    # Kubernetes refuses loadBalancerClass on other types: left out there.
    cluster_ip = by_kind(render(*knobs), "Service")["crescent-gateway"]["spec"]
    assert "loadBalancerClass" not in cluster_ip and "loadBalancerSourceRanges" not in cluster_ip
    assert helm_template("--set-json", 'gateway.service.loadBalancerSourceRanges=["everyone"]').returncode != 0


SCHEDULING = {
    "priorityClassName": "serving-critical",
    "runtimeClassName": "nvidia",
    "schedulerName": "kai-scheduler",
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                   "whenUnsatisfiable": "ScheduleAnyway",
                                   "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "crescent"}}}],
    "podLabels": {"cost-center": "ml-serving"},
}


def _scheduling_args(component: str) -> list[str]:
    return [arg for key, value in SCHEDULING.items() for arg in ("--set-json", f"{component}.{key}={json.dumps(value)}")]


@pytest.mark.parametrize("multi_node", [False, True], ids=["deployments", "leaderworkerset"])
def test_every_pod_takes_the_scheduling_values_of_its_component(tmp_path: Path, multi_node: bool) -> None:
    args = ["--set", "aggregated.enabled=true"]
    if multi_node:
        args += ["--set", "decode.multiNode.enabled=true", "--set-json", 'decode.multiNode.workerArgs=["decode-worker"]']
    for component in COMPONENTS:
        args += _scheduling_args(component)
    result = helm_template(*args)
    assert result.returncode == 0, result.stderr
    _validate(tmp_path, result.stdout, "1.30.0")  # each field where Kubernetes expects it
    templates = _pod_templates([d for d in yaml.safe_load_all(result.stdout) if d])
    if multi_node:
        assert {"crescent-decode-g0/leader", "crescent-decode-g0/worker"} <= set(templates)
    assert len(templates) >= 6
    for name, template in templates.items():
        spec = template["spec"]
        for key in ("priorityClassName", "runtimeClassName", "schedulerName", "topologySpreadConstraints"):
            assert spec[key] == SCHEDULING[key], (name, key)
        assert template["metadata"]["labels"]["cost-center"] == "ml-serving", name
        assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "crescent", name
    # Unset, none of them appears (the cluster's defaults apply).
    for name, template in _pod_templates(render("--set", "aggregated.enabled=true")).items():
        assert not {"priorityClassName", "runtimeClassName", "schedulerName", "topologySpreadConstraints"} & set(template["spec"]), name


def test_each_component_is_scheduled_on_its_own_values() -> None:
    templates = _pod_templates(render(*_scheduling_args("kvstore")))
    assert templates["crescent-kvstore"]["spec"]["priorityClassName"] == "serving-critical"
    assert "priorityClassName" not in templates["crescent-decode-g0"]["spec"]


@pytest.mark.parametrize("label", ["app.kubernetes.io/component", "crescent.io/group", "helm.sh/chart"])
def test_pod_labels_cannot_replace_the_labels_that_select_the_pods(label: str) -> None:
    result = helm_template("--set-json", f'decode.podLabels={{"{label}":"x"}}')
    assert result.returncode != 0 and "decode.podLabels" in result.stderr and label in result.stderr


def test_s3_credentials_from_the_pods_cloud_identity() -> None:
    """serviceAccount.annotations name a cloud role; the kvstore then takes no keys from a Secret."""
    s3 = ["--set", "kvstore.s3.enabled=true", "--set", "kvstore.s3.bucket=kv",
          "--set-json", 'serviceAccount.annotations={"eks.amazonaws.com/role-arn":"arn:aws:iam::123456789012:role/kv"}']
    docs = render(*s3, "--set", "kvstore.s3.credentialsFrom=workloadIdentity")
    (container,) = by_kind(docs, "DaemonSet")["crescent-kvstore"]["spec"]["template"]["spec"]["containers"]
    assert not {e["name"] for e in container["env"]} & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert yaml.safe_load(by_kind(docs, "ConfigMap")["crescent-kvstore"]["data"]["config.yaml"])["tiers"]["s3"]["bucket"] == "kv"
    both = helm_template(*s3, "--set", "kvstore.s3.credentialsFrom=workloadIdentity", "--set", "kvstore.s3.existingSecret=kv")
    assert both.returncode != 0 and "credentialsFrom" in both.stderr
    assert helm_template(*s3).returncode != 0, "the default still needs the Secret"
