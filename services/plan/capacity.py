"""What a hybrid (K3-class) model needs on N GPUs of one shape: the numbers behind ``crescent plan``.

Weights: every tensor in the format its checkpoint stores it (``formats.py``: a directory's
quantization_config and dtype — K3's MXFP4 routed experts and latent projections at 4.25 bits per
weight, the rest bf16; a bf16 Kimi-Linear all bf16 — or, for a preset, routed experts as
``--experts`` says and the rest bf16). Layouts of one engine instance over its N GPUs:

- ``TP{N}``: every matrix split N ways, experts included.
- ``EP{N}, attn TP{t}×DP{N/t}``: whole experts spread over the N GPUs; the rest (attention,
  dense FFNs, embeddings) split t ways inside each of N/t data-parallel groups, each group
  running its own sequences (SGLang's "DP attention"; t = N is plain TP, t = 1 replicates it).

MLA's latent is shared by all heads, so under attention TP every GPU of a group keeps the whole
latent cache of the group's sequences; KDA states split by value head.

Per sequence (docs/k3.md, ``memory.k3_footprint``): the MLA latents of every token (bf16), one
live KDA state (fp32 states and conv tails) and a bounded snapshot budget (fp32 states, bf16 tails) — at most
``snapshots`` KDA state snapshots of its cached prefix (every k-th block and turn ends), on prefill
only: decode resumes no prefix, and the Helm values give it none (``helm_values``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from crescent.services.engine.kimi_k3.config import K3_FULL, NANO, K3Config
from crescent.services.engine.kimi_k3.memory import k3_footprint
from crescent.services.engine.kimi_k3.weights import weight_shapes
from crescent.services.plan.formats import EXPERT_FORMATS, FORMAT_BITS, WeightFormat, directory_format, preset_format
from crescent.services.plan.gpus import GpuShape, PlanInputError

EXPERT_BITS = {f: FORMAT_BITS[f] for f in EXPERT_FORMATS}  # --experts for a preset
LATENT_BYTES = 2  # MLA latents and KDA conv tails in the model's dtype (bf16)
# bytes of a cached MLA latent element per kv cache dtype (EngineSettings.kv_cache_dtype, vLLM's
# --kv-cache-dtype): fp8 (e4m3) halves the latents; conv tails and KDA states keep theirs
KV_CACHE_DTYPE_BYTES = {"auto": LATENT_BYTES, "fp8": 1}
STATE_BYTES = 4  # KDA recurrent states in fp32, as the kernels keep them
PLAN_PRESETS = {"kimi-k3": K3_FULL, "kimi-k3-nano": NANO}


@dataclass(frozen=True, slots=True)
class PlannedK3:
    """A K3-class model to plan: its id, config, how its weights are stored, and the checkpoint's
    module name of each Crescent tensor name (what a quantization_config's ignore list names)."""

    model_id: str
    config: K3Config
    weights: WeightFormat
    module_name: Callable[[str], str] = str


def resolve_plan_model(spec: str, experts: str | None = None) -> PlannedK3:
    """A preset (``kimi-k3``: the published shape; ``kimi-k3-nano``), planned with ``experts``
    (default MXFP4), or a model directory / its config.json, read by the K3 loader (Crescent's
    format, ``kimi_k3`` nested, ``kimi_linear``) and planned as its checkpoint stores it
    (``formats.checkpoint_format``: its quantization_config and dtype)."""
    if spec.lower() in PLAN_PRESETS:
        return PlannedK3(spec.lower(), PLAN_PRESETS[spec.lower()], preset_format(experts))
    path = Path(spec).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not (path / "config.json").is_file():
        raise PlanInputError(f"--model {spec!r}: not a preset ({', '.join(PLAN_PRESETS)}) "
                             "nor a directory with a config.json")
    # the loader owns the formats
    from crescent.services.engine.kimi_k3.loading import read_any_config
    from crescent.services.engine.kimi_k3.real_checkpoint import real_name
    from crescent.services.model.hf_config import read_config_json

    try:
        cfg, real = read_any_config(path)
    except ValueError as exc:  # ModelLoadError / ModelConfigError name the field
        raise PlanInputError(f"--model {spec!r}: {exc}") from exc
    if real is None:  # Crescent's own format: its config does not say how its tensors are stored
        return PlannedK3(path.resolve().name, cfg, preset_format(experts))
    fmt = directory_format(path, read_config_json(path), experts, cfg.cache_dtype)
    return PlannedK3(path.resolve().name, cfg, fmt, lambda name: real_name(real, name))


@dataclass(frozen=True, slots=True)
class WeightBytes:
    routed_params: int   # routed expert weights (what EP spreads)
    other_params: int    # everything else
    routed_bytes: int
    other_bytes: int
    expert_format: str = "mxfp4"     # the routed experts' format
    other_format: str = "bf16"       # the rest's, where not quantized
    other_quantized_params: int = 0  # of other_params, those stored quantized (K3: latent MoE projections, dense MLPs)
    source: str = "--experts"        # where the formats come from (a checkpoint's quantization_config, ...)

    @property
    def total_bytes(self) -> int:
        return self.routed_bytes + self.other_bytes


def weight_bytes(cfg: K3Config, fmt: WeightFormat | str = "mxfp4",
                 module_name: Callable[[str], str] = str) -> WeightBytes:
    """Bytes of every weight of ``cfg`` as ``fmt`` stores it; ``module_name`` maps a Crescent tensor
    name onto the checkpoint's (what a quantization_config's ignore list names)."""
    if isinstance(fmt, str):
        fmt = preset_format(fmt)
    routed = other = other_quant = 0
    routed_bits = other_bits = 0.0
    for name, shape in weight_shapes(cfg).items():
        n, is_routed = math.prod(shape), ".mlp.experts." in name
        module = module_name(name).removesuffix(".weight").replace("{e}", "0").replace("w1/w3", "w1")
        quantized = fmt.quantized(module, shape[-1], is_routed)
        bits = FORMAT_BITS[fmt.quant if quantized and fmt.quant else fmt.plain] * n
        if is_routed:
            routed, routed_bits = routed + n, routed_bits + bits
        else:
            other, other_bits, other_quant = other + n, other_bits + bits, other_quant + (n if quantized else 0)
    return WeightBytes(routed, other, math.ceil(routed_bits / 8), math.ceil(other_bits / 8),
                       expert_format=fmt.expert_format, other_format=fmt.plain, other_quantized_params=other_quant,
                       source=fmt.source)


@dataclass(frozen=True, slots=True)
class SequenceBytes:
    context_tokens: int
    latent_bytes: int     # MLA latents of every token
    state_bytes: int      # the one live KDA state (+ conv tails, fp32)
    snapshot_bytes: int   # the bounded snapshot budget

    @property
    def total_bytes(self) -> int:
        return self.latent_bytes + self.state_bytes + self.snapshot_bytes


def sequence_bytes(cfg: K3Config, context_tokens: int, snapshots: int, kv_cache_dtype: str = "auto") -> SequenceBytes:
    fp = k3_footprint(cfg, kv_dtype_bytes=KV_CACHE_DTYPE_BYTES[kv_cache_dtype], tail_dtype_bytes=LATENT_BYTES,
                      state_dtype_bytes=STATE_BYTES)
    return SequenceBytes(context_tokens, context_tokens * fp.kv_bytes_per_token, fp.state_bytes_per_sequence,
                         snapshots * fp.snapshot_bytes_per_block)


@dataclass(frozen=True, slots=True)
class LayoutPlan:
    name: str
    weights_per_gpu: int
    cache_budget_per_gpu: int    # what memory_utilization leaves after the weights (may be < 0)
    sequence_bytes_per_gpu: int  # one sequence's cache on each GPU that holds it
    sequences: int               # full-context sequences the instance holds at once
    tensor_parallel: int = 1     # GPUs each attention group splits its layers over (t)
    data_parallel: int = 1       # attention groups, each with its own sequences (n / t)
    expert_parallel: bool = False  # whole experts spread over all n GPUs

    @property
    def fits(self) -> bool:
        return self.sequences > 0


def layout_plans(cfg: K3Config, weights: WeightBytes, seq: SequenceBytes, gpus: int, gpu: GpuShape,
                 memory_utilization: float) -> list[LayoutPlan]:
    """TP over all GPUs, then EP with attention TP t × DP n/t for every t dividing n (largest t first)."""
    usable = int(gpu.memory_bytes * memory_utilization)
    n = gpus
    experts_per_gpu = math.ceil(cfg.num_experts / n)
    ep_routed = math.ceil(weights.routed_bytes * experts_per_gpu / cfg.num_experts)
    rows = [(f"TP{n}", math.ceil(weights.total_bytes / n), n, False)]
    for t in (d for d in range(n, 0, -1) if n % d == 0):
        attn = f"TP{t}" if t == n else f"DP{n}" if t == 1 else f"TP{t}×DP{n // t}"
        rows.append((f"EP{n}, attn {attn}", ep_routed + math.ceil(weights.other_bytes / t), t, True))
    plans = []
    for name, w, t, ep in rows:
        # a sequence's latents sit on every GPU of its group; its KDA state is split by value head
        head_share = math.ceil(cfg.kda_num_v_heads / t) / cfg.kda_num_v_heads
        per_seq = seq.latent_bytes + math.ceil((seq.state_bytes + seq.snapshot_bytes) * head_share)
        budget = usable - w
        fit = max(0, budget) // per_seq * (n // t) if per_seq else 0
        plans.append(LayoutPlan(name, w, budget, per_seq, fit, tensor_parallel=t, data_parallel=n // t,
                                expert_parallel=ep))
    return plans


def min_gpus_to_fit(cfg: K3Config, weights: WeightBytes, seq: SequenceBytes, gpu: GpuShape,
                    memory_utilization: float, limit: int = 1024) -> int | None:
    """The fewest GPUs of this shape on which some layout holds one full-context sequence."""
    for n in range(1, limit + 1):
        if any(p.fits for p in layout_plans(cfg, weights, seq, n, gpu, memory_utilization)):
            return n
    return None


def helm_values(model_id: str, gpus: int, gpu: GpuShape, best: LayoutPlan, context_tokens: int,
                block_size: int, snapshots: int = 0, snapshot_every_blocks: int = 0,
                decode: LayoutPlan | None = None, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """prefill/decode values of the chart (helm/crescent/values.yaml) for one instance per pod,
    setting exactly the snapshot budget the plan counted: prefill's prefix cache gets
    ``snapshots`` per sequence (``state_snapshots`` = sequences × snapshots), kept at turn ends and
    every ``snapshot_every_blocks`` blocks (0: turn ends only — what docs/k3.md's replay favours
    for a pool this small); decode keeps none (``state_snapshots: 0``: it resumes no prefix), so
    ``decode`` — the same layout planned without snapshots — sizes its batch."""
    decode = decode or best

    def pool(plan: LayoutPlan, **engine_extra: int) -> dict[str, Any]:  # a fresh dict per pool: no YAML anchors
        out: dict[str, Any] = {"gpus": gpus}
        if gpu.product_label:
            out["nodeSelector"] = {"nvidia.com/gpu.product": gpu.product_label}
        engine: dict[str, Any] = {"kv_capacity_tokens": plan.sequences * context_tokens, "block_size": block_size}
        if kv_cache_dtype != "auto":  # the dtype the plan counted the latents in
            engine["kv_cache_dtype"] = kv_cache_dtype
        out["settings"] = {"engine": {**engine, **engine_extra}}
        return out

    prefill = pool(best, state_snapshots=best.sequences * snapshots, state_snapshot_every_blocks=snapshot_every_blocks)
    return {"model": {"id": model_id}, "prefill": prefill,
            "decode": pool(decode, max_batch_size=decode.sequences, state_snapshots=0)}


def as_dict(**parts: Any) -> dict[str, Any]:
    """Dataclasses and plain values as JSON-ready dicts (``--json``)."""
    out: dict[str, Any] = {}
    for key, value in parts.items():
        if isinstance(value, list):
            out[key] = [_one(v) for v in value]
        else:
            out[key] = _one(value)
    return out


def _one(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        data = asdict(value)
        for prop in ("total_bytes", "fits"):
            if hasattr(value, prop):
                data[prop] = getattr(value, prop)
        return data
    return value
