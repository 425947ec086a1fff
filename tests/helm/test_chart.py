"""The Helm chart: lint, render with realistic values, validate against Kubernetes' schemas."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helm.tools import CHART, EXAMPLES, helm_template, run, tool

VALUES_FILES = {
    "defaults": [],
    "cpu-dev": [EXAMPLES / "cpu-dev.yaml"],
    "one-supernode-8gpu": [EXAMPLES / "one-supernode-8gpu.yaml"],
    "four-supernodes": [EXAMPLES / "four-supernodes.yaml"],
}
# Kinds the Kubernetes schemas cannot know: custom resources of the Prometheus Operator, KEDA,
# cert-manager, LeaderWorkerSet, Gateway API and the Inference Extension. kubernetes-validate
# bundles only built-in kinds, so ServiceMonitor, PrometheusRule, ScaledObject, LeaderWorkerSet,
# HTTPRoute and InferencePool are checked against their own schemas in test_crd_schemas.py
# (cert-manager's kinds only by the tests of their templates).
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject", "Certificate", "Issuer", "LeaderWorkerSet",
                "InferencePool", "HTTPRoute"}
# Everything optional switched on, so validation sees every template.
ALL_ON = [
    "--set", "gateway.ingress.enabled=true",
    "--set", "gateway.httpRoute.enabled=true",
    "--set-json", 'gateway.httpRoute.parentRefs=[{"name":"public","namespace":"gateways","sectionName":"https"}]',
    "--set", "monitoring.serviceMonitor.enabled=true",
    "--set", "monitoring.prometheusRule.enabled=true",
    "--set", "monitoring.dashboards.enabled=true",
    "--set", "prefill.autoscaling.enabled=true",
    "--set", "monitoring.prometheusAdapter.enabled=true",
    "--set", "decode.autoscaling.keda.enabled=true",
    "--set", "aggregated.enabled=true",
    "--set", "aggregated.autoscaling.enabled=true",
    "--set", "decode.multiNode.enabled=true",
    "--set-json", 'decode.multiNode.workerArgs=["decode-worker"]',
    "--set", "model.weights.source=pvc",
    "--set", "model.weights.pvc.create=true",
    "--set", "internalTls.certManager.enabled=true",
    "--set", "internalTls.certManager.adminCertificate=true",
    "--set", "inferenceExtension.enabled=true",
]


@pytest.mark.parametrize("name", sorted(VALUES_FILES))
def test_lint_strict(name: str) -> None:
    cmd = [tool("helm"), "lint", "--strict", str(CHART)]
    for path in VALUES_FILES[name]:
        cmd += ["-f", str(path)]
    result = run(cmd)
    assert result.returncode == 0, result.stdout + result.stderr


def _validate(tmp_path: Path, manifest: str, version: str) -> None:
    path = tmp_path / "rendered.yaml"
    path.write_text(manifest)
    result = run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", version, str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    # A resource without a schema is only a warning; allow it for custom resources alone, so a
    # misspelt apiVersion of a built-in kind cannot slip through unvalidated.
    for line in (result.stdout + result.stderr).splitlines():
        if "Couldn't find schema" in line:
            assert any(f"kind {kind} " in line for kind in CUSTOM_KINDS), line


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
@pytest.mark.parametrize("name", sorted(VALUES_FILES))
def test_rendered_manifests_are_valid_kubernetes(tmp_path: Path, name: str, version: str) -> None:
    result = helm_template(values=VALUES_FILES[name])
    assert result.returncode == 0, result.stderr
    _validate(tmp_path, result.stdout, version)


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
def test_every_optional_template_is_valid_kubernetes(tmp_path: Path, version: str) -> None:
    result = helm_template(*ALL_ON)
    assert result.returncode == 0, result.stderr
    _validate(tmp_path, result.stdout, version)


def test_kube_version_below_1_30_is_refused() -> None:
    result = helm_template("--kube-version", "1.29.0")
    assert result.returncode != 0
    assert "kubeVersion" in result.stderr or "incompatible" in result.stderr
