"""``crescent plan``: print what a model needs on a GPU shape, and the Helm values that follow.

    crescent plan --model kimi-k3 --gpus 16xH200 --context 256k --backend vllm
    crescent plan --model qwen3-32b --gpus 1xH200 --context 32k --backend vllm

The tables go to stderr; stdout gets the chart values (YAML), or every figure as JSON with
``--json``. Exit status 1 when no layout holds one full-context sequence (the message names the
fewest GPUs of that shape that would). ``--backend native`` (the default) writes prefill/decode
pool values for K3-class models, one instance per pod, so only for an instance that fits on one
node; ``--backend vllm`` writes aggregated values for vLLM's engine (vllm_values.py), a
LeaderWorkerSet for an instance over several nodes. The arithmetic is ``capacity.py``'s (K3-class:
docs/k3.md explains it) and ``dense.py``'s (dense GQA models such as Qwen3-32B).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from crescent.services.engine.kimi_k3.config import K3Config
from crescent.services.contract.block_keys import DEFAULT_BLOCK_SIZE
from crescent.services.plan.capacity import (
    EXPERT_BITS,
    KV_CACHE_DTYPE_BYTES,
    LayoutPlan,
    SequenceBytes,
    WeightBytes,
    as_dict,
    helm_values,
    layout_plans,
    min_gpus_to_fit,
    sequence_bytes,
    weight_bytes,
)
from crescent.services.plan.dense import DenseConfig, dense_layouts, dense_min_gpus
from crescent.services.plan.gpus import GPUS, GpuShape, PlanInputError, parse_gpus, parse_tokens
from crescent.services.plan.vllm_values import plan_model, vllm_helm_values, vllm_runnable

console = Console(stderr=True)
BACKENDS = ("native", "vllm")


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if abs(n) >= 1e8 else f"{n / 1e6:,.1f} MB"


def plan_command(
    gpus: Annotated[str, typer.Option(help="GPUs of one engine instance, COUNTxNAME: " +
                                      ", ".join(g.name for g in GPUS.values()))],
    model: Annotated[str, typer.Option(help="kimi-k3 (the published shape), kimi-k3-nano, qwen3-32b, or a model "
                                       "directory (config.json: kimi_k3, kimi_linear, or a dense qwen3/qwen2/"
                                       "llama/mistral model)")] = "kimi-k3",
    context: Annotated[str | None, typer.Option(help="tokens per sequence: 131072, 128k, 1M (binary units); "
                                                "default: the model's max_position_embeddings")] = None,
    experts: Annotated[str | None, typer.Option(help="K3-class presets: routed expert weights, " + ", ".join(EXPERT_BITS)
                                                + " (default mxfp4); a checkpoint directory is planned as its "
                                                "quantization_config and dtype store it")] = None,
    snapshots: Annotated[int, typer.Option(min=0, help="K3-class: KDA state snapshots each sequence's cached "
                                           "prefix may keep on prefill (the bounded snapshot budget; the values "
                                           "set state_snapshots = sequences x this; decode keeps none)")] = 4,
    snapshot_every_blocks: Annotated[int, typer.Option(min=0, help="K3-class: prefill keeps a snapshot every this "
                                                       "many blocks as well as at turn ends (0: turn ends only)")] = 0,
    block_size: Annotated[int, typer.Option(min=1, help="tokens per KV block (native values)")] = DEFAULT_BLOCK_SIZE,
    memory_utilization: Annotated[float, typer.Option(min=0.05, max=1.0, help="share of each GPU's memory for "
                                                      "weights and cache (the rest: activations, workspaces); "
                                                      "vLLM's gpuMemoryUtilization")] = 0.9,
    backend: Annotated[str, typer.Option(help="engine backend the Helm values are for: native (prefill/decode "
                                         "pools) or vllm (aggregated instances running vLLM)")] = "native",
    kv_cache_dtype: Annotated[str, typer.Option(help="K3-class: dtype of the MLA latent cache, auto (the model's, "
                                                "bf16) or fp8 (e4m3, half the latent bytes; KDA states and conv "
                                                "tails keep theirs); set in the values as kv_cache_dtype")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="every figure as JSON on stdout")] = False,
) -> None:
    """Weights per GPU under TP/EP layouts, cache bytes per sequence, sequences that fit, Helm values."""
    try:
        if backend not in BACKENDS:
            raise PlanInputError(f"--backend {backend!r}: expected one of {', '.join(BACKENDS)}")
        n, gpu = parse_gpus(gpus)
        if experts is not None and experts not in EXPERT_BITS:
            raise PlanInputError(f"--experts {experts!r}: expected one of {', '.join(EXPERT_BITS)}")
        pm = plan_model(model, experts)
        cfg = pm.config
        if kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
            raise PlanInputError(f"--kv-cache-dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPE_BYTES)}")
        if kv_cache_dtype != "auto" and isinstance(cfg, DenseConfig):
            raise PlanInputError("--kv-cache-dtype fp8 is planned for K3-class models (MLA latents) only")
        tokens = parse_tokens(context) if context is not None else cfg.max_position_embeddings
        if tokens > cfg.max_position_embeddings:  # the context window every component serves (hf_config)
            raise PlanInputError(f"--context {tokens:,} tokens exceeds the model's context window "
                                 f"({cfg.max_position_embeddings:,}: the smallest length key of its config)")
    except PlanInputError as exc:
        raise typer.BadParameter(str(exc)) from None

    figures: dict[str, Any]
    if isinstance(cfg, DenseConfig):
        plans = dense_layouts(cfg, tokens, n, gpu, memory_utilization)
        needed = dense_min_gpus(cfg, tokens, gpu, memory_utilization)
        _print_dense_tables(pm.model_id, cfg, n, gpu, tokens, memory_utilization, plans)
        figures = {"weights": {"params": cfg.params, "bytes": cfg.weight_bytes},
                   "kv_bytes_per_token": cfg.kv_bytes_per_token}
    else:
        assert pm.k3 is not None  # a K3-class model always carries its weight format
        weights = weight_bytes(cfg, pm.k3.weights, pm.k3.module_name)
        seq = sequence_bytes(cfg, tokens, snapshots, kv_cache_dtype)
        plans = layout_plans(cfg, weights, seq, n, gpu, memory_utilization)
        # decode keeps no snapshots (its values say state_snapshots: 0): its sequences without them
        decode_plans = layout_plans(cfg, weights, sequence_bytes(cfg, tokens, 0, kv_cache_dtype), n, gpu,
                                    memory_utilization)
        needed = min_gpus_to_fit(cfg, weights, seq, gpu, memory_utilization)
        _print_tables(pm.model_id, n, gpu, tokens, snapshots, memory_utilization, weights, seq, plans,
                      cfg.num_experts)
        figures = {"expert_format": weights.expert_format, "weights": weights, "sequence": seq,
                   "snapshot_every_blocks": snapshot_every_blocks, "decode_layouts": decode_plans,
                   "kv_cache_dtype": kv_cache_dtype}

    candidates = [p for p in plans if vllm_runnable(p, n, gpu)] if backend == "vllm" else plans
    best = max(candidates, key=lambda p: p.sequences) if candidates else None
    fits = best is not None and best.fits
    one_node = n <= gpu.gpus_per_node
    values = None
    if fits and backend == "vllm":
        values = vllm_helm_values(pm.model_id, n, gpu, best, tokens, memory_utilization, pm.quantization,
                                  trust_remote_code=isinstance(cfg, K3Config), kv_cache_dtype=kv_cache_dtype)
    elif fits and one_node and not isinstance(cfg, DenseConfig):
        decode_best = next(p for p in decode_plans if p.name == best.name)
        values = helm_values(pm.model_id, n, gpu, best, tokens, block_size, snapshots, snapshot_every_blocks,
                             decode=decode_best, kv_cache_dtype=kv_cache_dtype)

    if not fits:
        more = f"at least {needed} × {gpu.name}" if needed else f"more than 1024 × {gpu.name}"
        if backend == "vllm" and any(p.fits for p in plans):
            more = "a layout whose tensor-parallel groups fit in one node (fewer GPUs per group, or whole nodes)"
        console.print(f"[red]does not fit[/red]: no layout holds one {tokens:,}-token sequence on "
                      f"{n} × {gpu.name}; it needs {more} at memory utilization {memory_utilization:g}")
    else:
        console.print(f"best{' for vLLM' if backend == 'vllm' else ''}: {best.name}, "
                      f"{best.sequences} concurrent {tokens:,}-token sequences")
        if values is None and isinstance(cfg, DenseConfig):
            console.print(f"[yellow]no Helm values[/yellow]: the native engine does not load {cfg.model_type} "
                          "models; --backend vllm writes values for vLLM's engine")
        elif values is None:
            console.print(f"[yellow]no Helm values[/yellow]: a {n}-GPU instance spans "
                          f"{-(-n // gpu.gpus_per_node)} nodes of {gpu.gpus_per_node} × {gpu.name}, and the native "
                          "engine runs one instance per pod (one node); --backend vllm spans nodes as a "
                          "LeaderWorkerSet")
    if as_json:
        out = as_dict(model=pm.model_id, gpus=n, gpu=gpu, context_tokens=tokens, backend=backend,
                      memory_utilization=memory_utilization, **figures, layouts=plans,
                      best=best.name if fits else None, min_gpus=needed, helm_values=values)
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    elif values is not None:
        note = ("aggregated instances on vLLM's engine" if backend == "vllm"
                else "the engines take no parallel-layout setting yet: one pod = one instance on these GPUs")
        sys.stdout.write(f"# crescent plan --model {model} --gpus {gpus} --context {tokens} --backend {backend}: "
                         f"{best.name}, {best.sequences} sequences\n# ({note})\n")
        sys.stdout.write(yaml.safe_dump(values, sort_keys=False))
    if not fits:
        raise typer.Exit(1)


def _print_dense_tables(model_id: str, cfg: DenseConfig, n: int, gpu: GpuShape, tokens: int, utilization: float,
                        plans: list[LayoutPlan]) -> None:
    console.print(f"[bold]{model_id}[/bold] ({cfg.model_type}, dense) on {n} × {gpu.name} ({_gb(gpu.memory_bytes)} "
                  f"each, {gpu.source}; {utilization:.0%} for weights and cache), {tokens:,} tokens per sequence")
    w = Table(title="weights and cache")
    w.add_column("part")
    w.add_column("figure", justify="right")
    w.add_row("parameters", f"{cfg.params / 1e9:,.2f} B")
    w.add_row(f"weights ({cfg.dtype_bytes} bytes each)", _gb(cfg.weight_bytes))
    w.add_row(f"KV per token ({cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim} x K,V)",
              f"{cfg.kv_bytes_per_token:,} B")
    w.add_row(f"KV of one {tokens:,}-token sequence", _gb(tokens * cfg.kv_bytes_per_token))
    console.print(w)
    _print_layouts(f"layouts on {n} × {gpu.name}", plans)


def _print_tables(model_id: str, n: int, gpu: GpuShape, tokens: int, snapshots: int,
                  utilization: float, weights: WeightBytes, seq: SequenceBytes, plans: list[LayoutPlan],
                  cfg_experts: int) -> None:
    console.print(f"[bold]{model_id}[/bold] on {n} × {gpu.name} ({_gb(gpu.memory_bytes)} each, {gpu.source}; "
                  f"{utilization:.0%} for weights and cache), {tokens:,} tokens per sequence")
    if n > gpu.nvlink_domain:
        console.print(f"[yellow]note[/yellow]: {n} GPUs span more than one NVLink domain "
                      f"({gpu.nvlink_domain}): tensor/expert traffic crosses the network")
    w = Table(title="weights")
    for col in ("part", "parameters", "format", "bytes"):
        w.add_column(col, justify="left" if col in ("part", "format") else "right")
    w.add_row("routed experts", f"{weights.routed_params / 1e9:,.2f} B", weights.expert_format,
              _gb(weights.routed_bytes))
    other = weights.other_format if not weights.other_quantized_params else (
        f"{weights.other_format}; {weights.other_quantized_params / 1e9:,.2f} B in {weights.expert_format}")
    w.add_row("everything else", f"{weights.other_params / 1e9:,.2f} B", other, _gb(weights.other_bytes))
    w.add_row("total", f"{(weights.routed_params + weights.other_params) / 1e9:,.2f} B", "", _gb(weights.total_bytes))
    console.print(w)
    console.print(f"formats from: {weights.source}")
    s = Table(title=f"cache of one {tokens:,}-token sequence")
    s.add_column("part")
    s.add_column("bytes", justify="right")
    s.add_row("MLA latents (bf16)", _gb(seq.latent_bytes))
    s.add_row("live KDA state (fp32, conv tails too)", _gb(seq.state_bytes))
    s.add_row(f"snapshot budget ({snapshots} states, conv tails bf16; prefill only)", _gb(seq.snapshot_bytes))
    s.add_row("total", _gb(seq.total_bytes))
    console.print(s)
    _print_layouts(f"layouts on {n} × {gpu.name} (EP: {-(-cfg_experts // n)} experts per GPU)", plans)


def _print_layouts(title: str, plans: list[LayoutPlan]) -> None:
    t = Table(title=title)
    for col in ("layout", "weights / GPU", "cache budget / GPU", "sequence / GPU", "sequences"):
        t.add_column(col, justify="left" if col == "layout" else "right", no_wrap=col == "layout")
    for p in plans:
        t.add_row(p.name, _gb(p.weights_per_gpu), _gb(p.cache_budget_per_gpu) if p.cache_budget_per_gpu > 0
                  else "[red]no room[/red]", _gb(p.sequence_bytes_per_gpu), str(p.sequences))
    console.print(t)
