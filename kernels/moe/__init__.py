"""Latent MoE: router with per-expert offsets, quantile balancing, shared experts, and a Triton
grouped expert matmul.

    x              [T, D]        tokens (float32/float16/bfloat16)
    router_weight  [E, D]        scores = sigmoid(x W_r^T), fp32 [T, E]
    offsets        [E]           selection offsets (see :func:`quantile_balance_offsets`)
    w_gate_up      [E, D, 2F]    routed experts: (act(x W_g) * x W_u) W_d
    w_down         [E, F, D]
    shared_gate_up [S, D, 2F_s]  shared experts, applied to every token
    shared_down    [S, F_s, D]

:func:`grouped_matmul` runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``. Routing,
quantile balancing, activations and the shared experts are plain PyTorch (dense, small).
A token's output depends only on that token: routing is row-wise and each token's k expert
outputs are summed in slot order (no atomics), so batching never changes a result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from crescent.kernels import _triton
from crescent.kernels._triton import check_device, check_float
from crescent.kernels.moe.grouped_matmul import grouped_matmul_kernel
from crescent.kernels.moe.reference import (
    expert_load,
    glu_expert,
    moe_reference,
    quantile_balance_offsets,
    route,
    router_scores,
)

__all__ = [
    "grouped_matmul",
    "moe_forward",
    "moe_reference",
    "route",
    "router_scores",
    "expert_load",
    "quantile_balance_offsets",
]


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
    """``out[r] = x[r] @ w[e]`` for rows ``group_offsets[e] <= r < group_offsets[e + 1]``.

    x ``[M, K]`` rows sorted by expert; w ``[E, K, N]``; group_offsets ``[E + 1]`` int32/int64
    (0 first, M last, non-decreasing). Returns ``[M, N]`` in x's dtype; fp32 accumulation.
    """
    check_float("x", x)
    check_float("w", w)
    if x.dim() != 2 or w.dim() != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"need x [M, K] and w [E, K, N], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    e = w.shape[0]
    if group_offsets.shape != (e + 1,) or group_offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_offsets must be int32/int64 [{e + 1}]")
    check_device(x, w, group_offsets)
    m, kd = x.shape
    n = w.shape[2]
    out = _triton.alloc((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk = 16, min(64, max(16, triton.next_power_of_2(n))), 32
    tile_offsets = _triton.row_tile_offsets(group_offsets, bm)
    grid = (triton.cdiv(m, bm) + e, triton.cdiv(n, bn))
    grouped_matmul_kernel[grid](
        x.contiguous(), w.contiguous(), out, group_offsets, tile_offsets, e, n, kd,
        BE=max(2, triton.next_power_of_2(e)), BM=bm, BN=bn, BK=bk,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return out


def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    top_k: int,
    routed_scale: float = 1.0,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    act=F.silu,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE layer on the grouped-matmul kernel. Returns (out ``[T, D]``, expert load ``[E]``)."""
    t, d = x.shape
    e = w_gate_up.shape[0]
    if router_weight.shape != (e, d) or offsets.shape != (e,):
        raise ValueError(f"router_weight must be [{e}, {d}] and offsets [{e}]")
    if w_gate_up.shape[1] != d or w_down.shape[0] != e or w_down.shape[2] != d:
        raise ValueError("expert weights must be w_gate_up [E, D, 2F] and w_down [E, F, D]")
    if not 0 < top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    weights, ids = route(router_scores(x, router_weight), offsets, top_k, routed_scale)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    load = torch.bincount(flat, minlength=e)
    group_offsets = torch.zeros(e + 1, dtype=torch.int64, device=x.device)
    group_offsets[1:] = load.cumsum(0)
    xs = x[order // top_k]
    gate, up = grouped_matmul(xs, w_gate_up, group_offsets).float().chunk(2, dim=-1)
    ys = grouped_matmul((act(gate) * up).to(x.dtype), w_down, group_offsets)
    per_slot = torch.empty(t * top_k, d, dtype=torch.float32, device=x.device)
    per_slot[order] = ys.float()
    out = (per_slot.view(t, top_k, d) * weights[..., None]).sum(1)
    if shared_gate_up is not None:
        for s in range(shared_gate_up.shape[0]):
            out += glu_expert(x, shared_gate_up[s], shared_down[s], act)
    return out.to(x.dtype), load
