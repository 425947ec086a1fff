"""fp32 PyTorch references for the latent MoE: routing, quantile balancing, expert FFNs.

Routing (aux-loss-free, DeepSeek-V3 / K3 style): scores s = sigmoid(x W_r^T) ``[T, E]``;
each token picks the top-k experts by ``s + offsets`` (offsets steer *selection* only) and
weights them by its raw scores renormalised over the chosen k, times ``routed_scale``.
Every step is row-wise, so a token's routing never depends on the rest of the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def router_scores(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """sigmoid(x W_r^T): x ``[T, D]``, router_weight ``[E, D]`` -> fp32 ``[T, E]``."""
    return torch.sigmoid(x.float() @ router_weight.float().t())


def route(
    scores: torch.Tensor, offsets: torch.Tensor, top_k: int, routed_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k selection over ``scores + offsets``; returns (weights ``[T, k]`` fp32, ids ``[T, k]``)."""
    ids = torch.topk(scores + offsets, top_k, dim=-1, sorted=True).indices
    chosen = scores.gather(-1, ids)
    weights = chosen / chosen.sum(-1, keepdim=True).clamp_min(1e-20) * routed_scale
    return weights, ids


def expert_load(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert (``[E]`` int64): the expert-load metric."""
    return torch.bincount(ids.flatten(), minlength=num_experts)


def quantile_balance_offsets(
    scores: torch.Tensor, top_k: int, *, iterations: int = 8, offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-expert selection offsets that equalise expected expert load, from score quantiles.

    scores: ``[T, E]`` router scores over a calibration sample (e.g. recent traffic).
    With offsets b, token t picks expert e iff ``s_te + b_e >= tau_t``, tau_t being the token's
    k-th largest adjusted score. Balanced load means each expert is picked by a share k/E of
    tokens, i.e. the (1 - k/E)-quantile over tokens of the margin ``s_te + b_e - tau_t`` is 0.
    Each iteration shifts every b_e by that quantile (a fixed-point step on the per-expert
    margin distributions; one step is already exact for thresholding, the rest absorb the
    tokens' thresholds moving). Replaces an auxiliary balance loss; at serving time the
    offsets are constants, so routing stays per-token and deterministic.

    Returns fp32 offsets ``[E]`` with mean 0 (a shared shift changes no selection).
    """
    t, e = scores.shape
    if not 0 < top_k < e:
        raise ValueError(f"top_k must be in [1, {e - 1}], got {top_k}")
    if t < e:
        raise ValueError(f"need at least E={e} calibration tokens, got {t}")
    s = scores.float()
    b = torch.zeros(e) if offsets is None else offsets.float().clone()
    level = 1.0 - top_k / e
    for _ in range(iterations):
        adj = s + b
        tau = adj.topk(top_k, dim=-1).values[:, -1:]
        b = b - torch.quantile(adj - tau, level, dim=0)
    return b - b.mean()


def glu_expert(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, act=F.silu) -> torch.Tensor:
    """One gated-MLP expert: (act(x W_g) * x W_u) W_d; w_gate_up ``[D, 2F]``, w_down ``[F, D]``."""
    gate, up = (x.float() @ w_gate_up.float()).chunk(2, dim=-1)
    return (act(gate) * up) @ w_down.float()


def moe_reference(
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
) -> torch.Tensor:
    """Routed experts (``w_gate_up [E, D, 2F]``, ``w_down [E, F, D]``) plus shared experts
    (``shared_gate_up [S, D, 2F_s]``, ``shared_down [S, F_s, D]``, applied to every token)."""
    weights, ids = route(router_scores(x, router_weight), offsets, top_k, routed_scale)
    out = torch.zeros(x.shape[0], x.shape[1])
    for e in range(w_gate_up.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            y = glu_expert(x[tok], w_gate_up[e], w_down[e], act)
            out.index_add_(0, tok, y * weights[tok, slot, None])
    if shared_gate_up is not None:
        for s in range(shared_gate_up.shape[0]):
            out += glu_expert(x, shared_gate_up[s], shared_down[s], act)
    return out.to(x.dtype)
