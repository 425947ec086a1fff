"""Writes helm/crescent/values.schema.json from values.yaml plus the constraints below.

    python helm/schema/generate.py          # regenerate the committed schema and README table
    python helm/schema/generate.py --check  # exit 1 if either is stale

Types come from the defaults in values.yaml (a null default takes its type from CONSTRAINTS);
every object rejects keys it does not list (additionalProperties: false) except the free-form
Kubernetes objects named in FREE_FORM, so a misspelt key fails `helm install`. CONSTRAINTS adds
enums, ranges and list item shapes. Each component's `settings` takes the schema of the settings
model its service loads (settings_schema.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from crescent.services.contract.roles import SERVICE_SETTINGS

sys.path.insert(0, str(Path(__file__).resolve().parent))
import values_table as readme  # noqa: E402 (beside this script)
from settings_schema import settings_schema  # noqa: E402 (beside this script)

CHART = Path(__file__).resolve().parent.parent / "crescent"
COMPONENTS = ("gateway", "scheduler", "prefill", "decode", "aggregated", "kvstore")
LATENCY_BUCKETS = [0.5, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120]  # crescent_gateway_ttft_seconds
TOKEN_INTERVAL_BUCKETS = [0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5]  # ..._tbt_seconds

# Keys holding Kubernetes or service objects the chart passes through unchanged.
FREE_FORM = {"resources", "nodeSelector", "affinity", "podAnnotations", "settings", "annotations", "labels",
             "podSecurityContext", "securityContext", "metricsNamespaceSelector", "proxyNamespaceSelector",
             "engineArgs", "podLabels", "timeouts",
             "global"}  # Helm's values shared with every subchart of an umbrella chart: any object
# List keys whose items are Kubernetes objects.
OBJECT_LISTS = {"extraEnv", "extraVolumes", "extraVolumeMounts", "tolerations", "topologySpreadConstraints",
                "parentRefs"}

PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
# US dollars, exact: a decimal string ("0.30"), or a number.
DOLLARS = {"type": ["string", "number"], "pattern": "^[0-9]+(\\.[0-9]+)?$", "minimum": 0}
PRICES = {"type": "object", "additionalProperties": False,
          "required": ["cacheHitInput", "cacheMissInput", "output"],
          "properties": {k: DOLLARS for k in ("cacheHitInput", "cacheMissInput", "output")}}
LIMIT_VALUES = {"properties": {"rpm": {"type": "integer", "minimum": 1}, "tpm": {"type": "integer", "minimum": 1},
                               "maxConcurrent": {"type": "integer", "minimum": 1}, "budgetUsd": DOLLARS}}


def _set_friendly(numbers: list[float]) -> dict[str, Any]:
    """One of `numbers`, given as a number or as the string `helm --set` passes for a decimal."""
    spelled: list[Any] = list(numbers)
    for n in numbers:
        spelled += [f"{n:g}"] + ([f"{n:g}.0"] if float(n).is_integer() else [])
    return {"type": ["number", "string"], "enum": spelled}


# A fraction given as a number or as a decimal string (`helm --set x=0.99` passes "0.99").
FRACTION = {"type": ["number", "string"], "exclusiveMinimum": 0, "exclusiveMaximum": 1, "pattern": "^0?\\.[0-9]*[1-9][0-9]*$"}
IMAGE_DIGEST = {"type": "string", "pattern": "^(sha256:[a-f0-9]{64})?$"}
IMAGE_TAG = {"type": "string", "minLength": 1, "not": {"const": "latest"}}
# A share in (0, 1], as a number or as the string `helm --set` passes.
SHARE = {"type": ["number", "string"], "exclusiveMinimum": 0, "maximum": 1,
         "pattern": "^(0?\\.[0-9]*[1-9][0-9]*|1(\\.0*)?)$"}
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "imagePullSecrets": {"items": {"type": "string", "minLength": 1}},
    "logLevel": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR"]},
    "model.id": {"minLength": 1},
    "model.weights.source": {"enum": ["image", "pvc", "init", "hostPath"]},
    "model.weights.hostPath": {"pattern": "^/"},
    "model.weights.init.gatewayCommand": {"items": {"type": "string"}},
    "hostPaths.ownership": {"enum": ["chown", "prepared"]},
    "model.weights.pvc.accessModes": {"items": {"enum": ["ReadOnlyMany", "ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"]}},
    "model.weights.init.command": {"items": {"type": "string"}},
    "model.weights.init.image.tag": IMAGE_TAG,
    "model.weights.init.image.digest": IMAGE_DIGEST,
    "slo.ttftSeconds": _set_friendly(LATENCY_BUCKETS),
    "slo.tbtSeconds": _set_friendly(TOKEN_INTERVAL_BUCKETS),
    "slo.objective": FRACTION,
    "topology.mode": {"enum": ["zone", "nvlinkDomain"]},
    "inferenceExtension.port": PORT,
    "inferenceExtension.failureMode": {"enum": ["FailClose", "FailOpen"]},
    "inferenceExtension.tls.clientCertificate": {"enum": ["none", "required"]},
    "topology.zoneLabel": {"minLength": 1},
    "topology.supernodeLabel": {"minLength": 1},
    "topology.groups": {
        "minItems": 1,
        "items": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]{0,14}[a-z0-9])?$"},
                "supernode": {"type": "string"},
                "zone": {"type": "string"},
            },
        },
    },
    "gateway.replicas": {"minimum": 1},
    "internalTls.selfSigned.days": {"minimum": 1},
    "internalTls.selfSigned.caDays": {"minimum": 1},
    "gateway.database.type": {"enum": ["sqlite", "postgresql"]},
    "gateway.database.sqlite.mountPath": {"pattern": "^/"},
    "gateway.database.sqlite.size": {"pattern": "^[0-9]+(\\.[0-9]+)?([KMGTPE]i?)?$"},
    "gateway.database.postgresql.urlKey": {"minLength": 1},
    "gateway.ledger.commitWaitSeconds": {"type": "number", "exclusiveMinimum": 0},
    "gateway.ledger.batchRows": {"minimum": 1, "maximum": 10000},
    "gateway.ledger.journalDir": {"pattern": "^(/.*)?$"},  # absolute, or empty for no journal
    "gateway.prices": {"properties": {}, "additionalProperties": PRICES},
    "gateway.limits.store": {"enum": ["memory", "redis"]},
    "gateway.limits.redis.urlKey": {"minLength": 1},
    "gateway.limits.key": LIMIT_VALUES,
    "gateway.limits.tenant": LIMIT_VALUES,
    "gateway.limits.tokenWeights.prompt": {"minimum": 0},
    "gateway.limits.tokenWeights.cached": {"minimum": 0},
    "gateway.limits.tokenWeights.completion": {"minimum": 0},
    "gateway.limits.onStoreError": {"enum": ["open", "closed"]},
    "gateway.limits.storeTimeoutSeconds": {"exclusiveMinimum": 0, "maximum": 10},
    "gateway.limits.leaseSeconds": {"exclusiveMinimum": 0, "maximum": 3600},
    "gateway.service.type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
    "gateway.service.loadBalancerSourceRanges": {"items": {"type": "string", "pattern": "^[0-9a-fA-F:.]+/[0-9]+$"}},
    "gateway.routedPaths": {"minItems": 1, "items": {"type": "string", "pattern": "^/"}},
    "gateway.httpRoute.hostnames": {"items": {"type": "string", "minLength": 1}},
    "kvstore.hostMemoryGiB": {"minimum": 1},
    "kvstore.sideChannel.port": PORT,
    "decode.handoffSideChannel.port": PORT,
    "kvstore.ssd.capacityGiB": {"minimum": 1},
    "kvstore.ssd.volume": {"enum": ["hostPath", "ephemeral"]},
    "kvstore.ssd.hostPath": {"pattern": "^(/.*)?$"},
    "kvstore.hugepages.pageSize": {"enum": ["2Mi", "1Gi"]},
    "kvstore.hugepages.sizeGiB": {"minimum": 0},
    "kvstore.updateStrategy.type": {"enum": ["RollingUpdate", "OnDelete"]},
    "kvstore.updateStrategy.maxUnavailable": {"type": ["integer", "string"], "minimum": 1, "pattern": "^[0-9]+%$"},
    "kvstore.s3.capacityGiB": {"minimum": 1},
    "kvstore.s3.credentialsFrom": {"enum": ["secret", "workloadIdentity"]},
    "monitoring.prometheusRule.rejectionRatio": FRACTION,
    "monitoring.prometheusRule.cacheHitRatioDropFraction": FRACTION,
    "monitoring.prometheusRule.instanceDownFor": {"pattern": "^[0-9]+[smh]$"},
    "monitoring.prometheusAdapter.namespace": {"pattern": "^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)?$"},
    "monitoring.serviceMonitor.interval": {"pattern": "^[0-9]+[smh]$"},
    "prefill.autoscaling.queueDepthTarget": {"minimum": 1},
    "decode.autoscaling.runningRequestsTarget": {"minimum": 1},
    "aggregated.autoscaling.queueDepthTarget": {"minimum": 1},
    "aggregated.autoscaling.kvUsedRatioTarget": FRACTION,
}
for _c in COMPONENTS:
    CONSTRAINTS[f"{_c}.image.tag"] = IMAGE_TAG
    CONSTRAINTS[f"{_c}.image.digest"] = IMAGE_DIGEST
    CONSTRAINTS[f"{_c}.image.pullPolicy"] = {"enum": ["Always", "IfNotPresent", "Never"]}
    for _port in ("port",) if _c == "gateway" else ("grpcPort", "adminPort"):
        CONSTRAINTS[f"{_c}.{_port}"] = PORT
for _c in ("gateway", "prefill", "decode", "aggregated"):  # the chart also fails a grace too short to drain in
    CONSTRAINTS[f"{_c}.terminationGracePeriodSeconds"] = {"minimum": 1}
    CONSTRAINTS[f"{_c}.preStopSleepSeconds"] = {"minimum": 0}
for _c in COMPONENTS:  # Kubernetes names (a DNS subdomain), or empty for the default
    for _key in ("priorityClassName", "runtimeClassName", "schedulerName"):
        CONSTRAINTS[f"{_c}.{_key}"] = {"pattern": "^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$", "maxLength": 253}
# A count or a percentage, as Kubernetes' IntOrString.
COUNT_OR_PERCENT = {"type": ["integer", "string"], "minimum": 0, "pattern": "^[0-9]+%$"}
for _role in ("prefill", "decode", "aggregated"):
    CONSTRAINTS[f"{_role}.rollingUpdate.maxSurge"] = COUNT_OR_PERCENT
    CONSTRAINTS[f"{_role}.rollingUpdate.maxUnavailable"] = COUNT_OR_PERCENT
    CONSTRAINTS[f"{_role}.autoscaling.scaleDownStabilizationSeconds"] = {"minimum": 0, "maximum": 3600}
    CONSTRAINTS[f"{_role}.replicas"] = {"minimum": 0}
    CONSTRAINTS[f"{_role}.gpus"] = {"minimum": 0}
    CONSTRAINTS[f"{_role}.autoscaling.minReplicas"] = {"minimum": 1}
    CONSTRAINTS[f"{_role}.autoscaling.maxReplicas"] = {"minimum": 1}
    CONSTRAINTS[f"{_role}.multiNode.nodesPerInstance"] = {"minimum": 2}
    CONSTRAINTS[f"{_role}.multiNode.workerArgs"] = {"items": {"type": "string"}}
    CONSTRAINTS[f"{_role}.multiNode.startupPolicy"] = {"enum": ["LeaderCreated", "LeaderReady"]}
    CONSTRAINTS[f"{_role}.backend"] = {"enum": ["native", "vllm"]}
    CONSTRAINTS[f"{_role}.startupProbeSeconds"] = {"minimum": 10}
# The vLLM backend's values (engine.vllm, services/engine_vllm/settings.py), for every engine role.
for _role in ("prefill", "decode", "aggregated"):
    CONSTRAINTS.update({
        f"{_role}.image.vllm.repository": {"minLength": 1},
        f"{_role}.image.vllm.tag": IMAGE_TAG,
        f"{_role}.image.vllm.digest": IMAGE_DIGEST,
        f"{_role}.vllm.dtype": {"enum": ["auto", "float32", "bfloat16", "float16"]},
        f"{_role}.vllm.maxModelLen": {"type": ["integer", "null"], "minimum": 16},
        f"{_role}.vllm.tensorParallelSize": {"minimum": 1},
        f"{_role}.vllm.pipelineParallelSize": {"minimum": 1},
        f"{_role}.vllm.dataParallelSize": {"minimum": 1},
        f"{_role}.vllm.quantization": {"type": ["string", "null"], "minLength": 1},
        f"{_role}.vllm.kvCacheDtype": {"minLength": 1},
        f"{_role}.vllm.gpuMemoryUtilization": SHARE,
        f"{_role}.vllm.cpuKvCacheGb": {"exclusiveMinimum": 0},
        f"{_role}.vllm.maxNumSeqs": {"type": ["integer", "null"], "minimum": 1},
        f"{_role}.vllm.maxNumBatchedTokens": {"type": ["integer", "null"], "minimum": 1},
    })


def infer(value: Any, path: str) -> dict[str, Any]:
    key = path.rsplit(".", 1)[-1]
    component = path.split(".", 1)[0]
    if key == "settings" and path == f"{component}.settings" and component in SERVICE_SETTINGS:
        schema = {"type": "object", **settings_schema(component)}  # the service's own model (settings_schema.py)
    elif key in FREE_FORM:
        schema: dict[str, Any] = {"type": "object"}
    elif key in OBJECT_LISTS:
        schema = {"type": "array", "items": {"type": "object"}}
    elif isinstance(value, dict):
        schema = {
            "type": "object",
            "additionalProperties": False,
            "properties": {k: infer(v, f"{path}.{k}" if path else k) for k, v in value.items()},
        }
    elif isinstance(value, bool):
        schema = {"type": "boolean"}
    elif isinstance(value, int):
        schema = {"type": "integer"}
    elif isinstance(value, float):
        schema = {"type": "number"}
    elif isinstance(value, str):
        schema = {"type": "string"}
    elif isinstance(value, list):
        schema = {"type": "array"}
    elif value is None and "type" in CONSTRAINTS.get(path, {}):
        schema = {}  # the type (null among them) comes from CONSTRAINTS below
    else:
        raise ValueError(f"values.yaml: cannot infer a type for {path} (null?); give it a typed default")
    schema.update(CONSTRAINTS.get(path, {}))
    return schema


def render() -> str:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    unknown = [p for p in CONSTRAINTS if not _has_path(values, p)]
    if unknown:
        raise ValueError(f"constraints for keys missing from values.yaml: {unknown}")
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "title": "Crescent chart values", **infer(values, "")}
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def _has_path(values: dict[str, Any], path: str) -> bool:
    node: Any = values
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def render_readme(schema_text: str) -> str:
    values_text = (CHART / "values.yaml").read_text()
    table = readme.values_table(values_text, yaml.safe_load(values_text), json.loads(schema_text))
    return readme.with_table((CHART / "README.md").read_text(), table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    schema_text = render()
    outputs = {CHART / "values.schema.json": schema_text, CHART / "README.md": render_readme(schema_text)}
    stale = [path for path, text in outputs.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path} is stale: run python helm/schema/generate.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(outputs[path])
    return 0


if __name__ == "__main__":
    sys.exit(main())
