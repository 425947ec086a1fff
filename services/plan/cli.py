"""``crescent plan``: print what a K3-class model needs on a GPU shape, and the Helm values that follow.

    crescent plan --model kimi-k3 --gpus 16xH200 --context 1M

The tables go to stderr; stdout gets the chart values (YAML), or every figure as JSON with
``--json``. Exit status 1 when no layout holds one full-context sequence (the message names the
fewest GPUs of that shape that would). The chart runs one engine instance per pod, so values are
written only for an instance that fits on one node. The arithmetic is ``capacity.py``'s;
docs/k3.md explains it.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.table import Table

from crescent.services.kvwire.block_keys import DEFAULT_BLOCK_SIZE
from crescent.services.plan.capacity import (
    EXPERT_BITS,
    LayoutPlan,
    SequenceBytes,
    WeightBytes,
    as_dict,
    helm_values,
    layout_plans,
    min_gpus_to_fit,
    resolve_plan_model,
    sequence_bytes,
    weight_bytes,
)
from crescent.services.plan.gpus import GPUS, GpuShape, PlanInputError, parse_gpus, parse_tokens

console = Console(stderr=True)


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if abs(n) >= 1e8 else f"{n / 1e6:,.1f} MB"


def plan_command(
    gpus: Annotated[str, typer.Option(help="GPUs of one engine instance, COUNTxNAME: " +
                                      ", ".join(g.name for g in GPUS.values()))],
    model: Annotated[str, typer.Option(help="kimi-k3 (the published shape), kimi-k3-nano, or a model "
                                       "directory (config.json)")] = "kimi-k3",
    context: Annotated[str | None, typer.Option(help="tokens per sequence: 131072, 128k, 1M (binary units); "
                                                "default: the model's max_position_embeddings")] = None,
    experts: Annotated[str, typer.Option(help="routed expert weights: " + ", ".join(EXPERT_BITS))] = "mxfp4",
    snapshots: Annotated[int, typer.Option(min=0, help="KDA state snapshots each sequence's cached prefix "
                                           "may keep (the bounded snapshot budget)")] = 4,
    block_size: Annotated[int, typer.Option(min=1, help="tokens per KV block")] = DEFAULT_BLOCK_SIZE,
    memory_utilization: Annotated[float, typer.Option(min=0.05, max=1.0, help="share of each GPU's memory for "
                                                      "weights and cache (the rest: activations, workspaces)")] = 0.9,
    as_json: Annotated[bool, typer.Option("--json", help="every figure as JSON on stdout")] = False,
) -> None:
    """Weights per GPU under TP/EP layouts, cache bytes per sequence, sequences that fit, Helm values."""
    try:
        n, gpu = parse_gpus(gpus)
        model_id, cfg = resolve_plan_model(model)
        tokens = parse_tokens(context) if context is not None else cfg.max_position_embeddings
        if tokens > cfg.max_position_embeddings:
            raise PlanInputError(f"--context {tokens:,} tokens exceeds the model's max_position_embeddings "
                                 f"({cfg.max_position_embeddings:,})")
        weights = weight_bytes(cfg, experts)
    except PlanInputError as exc:
        raise typer.BadParameter(str(exc)) from None
    seq = sequence_bytes(cfg, tokens, snapshots)
    plans = layout_plans(cfg, weights, seq, n, gpu, memory_utilization)
    best = max(plans, key=lambda p: p.sequences)
    fits = best.fits
    one_node = n <= gpu.gpus_per_node
    values = helm_values(model_id, n, gpu, best, tokens, block_size, snapshots) if fits and one_node else None
    needed = None if fits else min_gpus_to_fit(cfg, weights, seq, gpu, memory_utilization)

    _print_tables(model_id, n, gpu, tokens, experts, snapshots, memory_utilization, weights, seq, plans,
                  cfg.num_experts)
    if not fits:
        more = f"at least {needed} × {gpu.name}" if needed else f"more than 1024 × {gpu.name}"
        console.print(f"[red]does not fit[/red]: no layout holds one {tokens:,}-token sequence on "
                      f"{n} × {gpu.name}; it needs {more} at memory utilization {memory_utilization:g}")
    else:
        console.print(f"best: {best.name}, {best.sequences} concurrent {tokens:,}-token sequences")
        if not one_node:
            console.print(f"[yellow]no Helm values[/yellow]: a {n}-GPU instance spans "
                          f"{-(-n // gpu.gpus_per_node)} nodes of {gpu.gpus_per_node} × {gpu.name}, and the chart "
                          "runs one engine instance per pod (one node); multi-node instances are not supported yet")
    if as_json:
        figures = as_dict(model=model_id, gpus=n, gpu=gpu, context_tokens=tokens, expert_format=experts,
                          memory_utilization=memory_utilization, weights=weights, sequence=seq, layouts=plans,
                          best=best.name if fits else None, min_gpus=needed, helm_values=values)
        sys.stdout.write(json.dumps(figures, indent=2) + "\n")
    elif values is not None:
        sys.stdout.write(f"# crescent plan --model {model} --gpus {gpus} --context {tokens}: {best.name}, "
                         f"{best.sequences} sequences\n# (the engines take no parallel-layout setting yet: "
                         "one pod = one instance on these GPUs)\n")
        sys.stdout.write(yaml.safe_dump(values, sort_keys=False))
    if not fits:
        raise typer.Exit(1)


def _print_tables(model_id: str, n: int, gpu: GpuShape, tokens: int, experts: str, snapshots: int,
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
    w.add_row("routed experts", f"{weights.routed_params / 1e9:,.2f} B", experts, _gb(weights.routed_bytes))
    w.add_row("everything else", f"{weights.other_params / 1e9:,.2f} B", "bf16", _gb(weights.other_bytes))
    w.add_row("total", f"{(weights.routed_params + weights.other_params) / 1e9:,.2f} B", "", _gb(weights.total_bytes))
    console.print(w)
    s = Table(title=f"cache of one {tokens:,}-token sequence")
    s.add_column("part")
    s.add_column("bytes", justify="right")
    s.add_row("MLA latents (bf16)", _gb(seq.latent_bytes))
    s.add_row("live KDA state (fp32, conv tails too)", _gb(seq.state_bytes))
    s.add_row(f"snapshot budget ({snapshots} states, conv tails bf16)", _gb(seq.snapshot_bytes))
    s.add_row("total", _gb(seq.total_bytes))
    console.print(s)
    t = Table(title=f"layouts on {n} × {gpu.name} (EP: {-(-cfg_experts // n)} experts per GPU)")
    for col in ("layout", "weights / GPU", "cache budget / GPU", "sequence / GPU", "sequences"):
        t.add_column(col, justify="left" if col == "layout" else "right", no_wrap=col == "layout")
    for p in plans:
        t.add_row(p.name, _gb(p.weights_per_gpu), _gb(p.cache_budget_per_gpu) if p.cache_budget_per_gpu > 0
                  else "[red]no room[/red]", _gb(p.sequence_bytes_per_gpu), str(p.sequences))
    console.print(t)
