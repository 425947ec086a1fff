"""``crescent plan --backend vllm``: which model a spec names, which layouts vLLM can run through the
chart, and the chart values for them (aggregated instances with ``aggregated.backend: vllm``;
helm/crescent/values.yaml, docs/operators.md "Engine backends on GPU pools").

A layout maps onto vLLM's engine arguments: attention tensor parallel t → ``tensorParallelSize``,
its n/t groups → ``dataParallelSize``, whole experts over the n GPUs → ``enableExpertParallel``
(vLLM's EP size is then t × n/t = n). An instance larger than one node is a LeaderWorkerSet of
``n / gpus_per_node`` pods; each pod runs an equal share of the data-parallel ranks and keeps its
tensor-parallel groups inside itself, so t must divide the GPUs of a node (vLLM's multi-node data
parallel deployment; tensor parallelism across nodes would need Ray, which the chart does not run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crescent.services.engine.kimi_k3.config import K3Config
from crescent.services.plan.capacity import PLAN_PRESETS, LayoutPlan, PlannedK3, resolve_plan_model
from crescent.services.plan.dense import DENSE_PRESETS, DENSE_TYPES, DenseConfig
from crescent.services.plan.gpus import GpuShape, PlanInputError

# The quantization_config.quant_method of Moonshot's K3 checkpoint: its routed experts are MXFP4 in
# compressed-tensors' mxfp4-pack-quantized format. vLLM must be told that method (or nothing): its
# `mxfp4` method is another format's (gpt-oss), and vLLM refuses a method the checkpoint does not declare.
K3_MXFP4_QUANTIZATION = "compressed-tensors"


@dataclass(frozen=True, slots=True)
class PlanModel:
    model_id: str
    config: K3Config | DenseConfig
    quantization: str | None  # the checkpoint's quant_method (what vLLM's --quantization must say)
    k3: PlannedK3 | None = None  # K3-class: how its weights are stored


def _read_config(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _quant_method(raw: dict[str, Any]) -> str | None:
    for where in (raw, raw.get("text_config") or {}):
        quant = where.get("quantization_config") if isinstance(where, dict) else None
        if isinstance(quant, dict) and quant.get("quant_method"):
            return str(quant["quant_method"])
    return None


def plan_model(spec: str, expert_format: str | None) -> PlanModel:
    """A K3-class preset or directory (capacity.py's), a dense preset (``qwen3-32b``) or a dense
    model directory (config.json ``model_type`` one of ``DENSE_TYPES``)."""
    name = spec.lower()
    if name in DENSE_PRESETS:
        return PlanModel(name, DENSE_PRESETS[name], None)
    if name in PLAN_PRESETS:
        k3 = resolve_plan_model(spec, expert_format)
        mxfp4 = k3.weights.expert_format == "mxfp4"
        return PlanModel(k3.model_id, k3.config, K3_MXFP4_QUANTIZATION if mxfp4 else None, k3)
    path = Path(spec).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    raw = _read_config(path) if (path / "config.json").is_file() else None
    if raw is not None and raw.get("model_type") in DENSE_TYPES:
        return PlanModel(path.resolve().name, DenseConfig.from_hf_dict(raw), _quant_method(raw))
    try:
        k3 = resolve_plan_model(spec, expert_format)
    except PlanInputError as exc:
        if raw is None:
            raise PlanInputError(f"{exc} (presets: {', '.join([*PLAN_PRESETS, *DENSE_PRESETS])})") from None
        raise
    return PlanModel(k3.model_id, k3.config, _quant_method(raw or {}), k3)


def vllm_runnable(layout: LayoutPlan, gpus: int, gpu: GpuShape) -> bool:
    """Whether the chart can run this layout with vLLM: in one pod, or spread over whole nodes with
    every tensor-parallel group inside a pod and the same number of data-parallel ranks on each."""
    if gpus <= gpu.gpus_per_node:
        return True
    nodes, rest = divmod(gpus, gpu.gpus_per_node)
    return rest == 0 and gpu.gpus_per_node % layout.tensor_parallel == 0 and layout.data_parallel % nodes == 0


def vllm_helm_values(model_id: str, gpus: int, gpu: GpuShape, layout: LayoutPlan, context_tokens: int,
                     memory_utilization: float, quantization: str | None, trust_remote_code: bool,
                     kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """Values for aggregated instances on vLLM: one instance of ``gpus`` GPUs per pod (as many pods
    as fill one node), or one LeaderWorkerSet instance over ``gpus / gpus_per_node`` nodes."""
    nodes = max(1, gpus // gpu.gpus_per_node) if gpus > gpu.gpus_per_node else 1
    vllm: dict[str, Any] = {"tensorParallelSize": layout.tensor_parallel, "dataParallelSize": layout.data_parallel,
                            "enableExpertParallel": layout.expert_parallel, "maxModelLen": context_tokens,
                            "gpuMemoryUtilization": memory_utilization}
    if quantization:
        vllm["quantization"] = quantization
    if trust_remote_code:
        vllm["trustRemoteCode"] = True
    if kv_cache_dtype != "auto":  # the dtype the plan counted the latents in
        vllm["kvCacheDtype"] = kv_cache_dtype
    aggregated: dict[str, Any] = {"enabled": True, "backend": "vllm",
                                  "replicas": 1 if nodes > 1 else max(1, gpu.gpus_per_node // gpus)}
    if gpu.product_label:
        aggregated["nodeSelector"] = {"nvidia.com/gpu.product": gpu.product_label}
    if nodes > 1:
        aggregated["multiNode"] = {"enabled": True, "nodesPerInstance": nodes}
    aggregated["vllm"] = vllm
    return {"model": {"id": model_id}, "prefill": {"enabled": False}, "decode": {"enabled": False},
            "aggregated": aggregated}
