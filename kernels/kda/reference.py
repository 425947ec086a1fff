"""fp32 PyTorch references for Kimi Delta Attention (KDA) and the pieces of its layer.

Notation (per value head, state S of shape K x V):
    S <- Diag(exp(g_t)) S
    S <- S + beta_t k_t (v_t - k_t^T S)^T
    o_t = q_t^T S
with q, k L2-normalised and q scaled by ``scale`` (default 1/sqrt(K)).

Shapes follow the kernels: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``
(log decay, <= 0); beta ``[B, T, HV]`` (in (0, 1), already through sigmoid); states
``[N, HV, K, V]`` in fp32. ``HV`` is a multiple of ``H`` (grouped value heads). With
``cu_seqlens`` (``[N + 1]`` cumulative offsets) B must be 1 and T is the packed length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the same eps as the kernels)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(
    f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float = -5.0
) -> torch.Tensor:
    """K3 lower-bounded per-channel log decay: g = lb * sigmoid(exp(A_log) * (f + dt_bias)).

    f: ``[..., HV, K]`` (the low-rank gate projection of x); a_log: ``[HV]``;
    dt_bias: ``[HV * K]`` or ``[HV, K]``. Returns fp32 g in (lb, 0).
    """
    hv, k = f.shape[-2:]
    x = f.float() + dt_bias.float().reshape(hv, k)
    return lower_bound * torch.sigmoid(a_log.float().reshape(hv, 1).exp() * x)


def kda_softplus_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi-Linear's unbounded per-channel log decay: g = -exp(A_log) * softplus(f + dt_bias).

    Shapes as :func:`kda_gate` (``a_log`` ``[HV]``). Returns fp32 g < 0.
    """
    hv, k = f.shape[-2:]
    x = f.float() + dt_bias.float().reshape(hv, k)
    return -a_log.float().reshape(hv, 1).exp() * F.softplus(x)


def _prepare(q, k, v, g, beta, scale):
    hv, h = v.shape[2], q.shape[2]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    rep = hv // h
    q = l2_normalize(q.float()).repeat_interleave(rep, dim=2) * scale
    k = l2_normalize(k.float()).repeat_interleave(rep, dim=2)
    return q, k, v.float(), g.float(), beta.float()


def _sequences(t: int, batch: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch index, start, end) of each sequence."""
    if cu_seqlens is None:
        return [(b, 0, t) for b in range(batch)]
    cu = cu_seqlens.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def recurrent_kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence, literally the update rule. Returns (o fp32, final state)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale)
    b, t, hv, dk = k.shape
    dv = v.shape[-1]
    seqs = _sequences(t, b, cu_seqlens)
    o = torch.zeros(b, t, hv, dv)
    final = torch.zeros(len(seqs), hv, dk, dv)
    for n, (bi, start, end) in enumerate(seqs):
        s = torch.zeros(hv, dk, dv) if initial_state is None else initial_state[n].float().clone()
        for i in range(start, end):
            s = s * g[bi, i].exp()[..., None]
            err = v[bi, i] - torch.einsum("hk,hkv->hv", k[bi, i], s)
            s = s + torch.einsum("hk,hv->hkv", k[bi, i], beta[bi, i][:, None] * err)
            o[bi, i] = torch.einsum("hk,hkv->hv", q[bi, i], s)
        final[n] = s
    return o, final


def _chunk_one(q, k, v, g, beta, s, chunk):
    """Chunkwise-parallel (WY) form for one sequence: q,k,g ``[T,HV,K]``, v ``[T,HV,V]``."""
    t = q.shape[0]
    out = torch.zeros_like(v)
    for c0 in range(0, t, chunk):
        sl = slice(c0, min(c0 + chunk, t))
        qc, kc, vc = q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1)
        gc = g[sl].transpose(0, 1).cumsum(1)  # [HV, C, K]
        bc = beta[sl].transpose(0, 1)  # [HV, C]
        c = qc.shape[1]
        # exact pairwise decays exp(gc_i - gc_j) for j <= i (masked before exp: no overflow)
        diff = gc[:, :, None, :] - gc[:, None, :, :]
        lower = torch.ones(c, c, dtype=torch.bool).tril()
        decay = torch.where(lower[None, :, :, None], diff, float("-inf")).exp()
        akk = torch.einsum("hik,hjk,hijk->hij", kc, kc, decay) * bc[:, :, None]
        strict = akk * (~torch.eye(c, dtype=torch.bool))
        eye = torch.eye(c).expand_as(strict)
        # T = (I + strict)^-1 diag(beta): the WY factors of the chunk's delta-rule updates
        tmat = torch.linalg.solve_triangular(eye + strict, eye, upper=False) * bc[:, None, :]
        w = tmat @ (kc * gc.exp())
        u = tmat @ vc
        vnew = u - w @ s
        aqk = torch.einsum("hik,hjk,hijk->hij", qc, kc, decay)
        out[sl] = ((qc * gc.exp()) @ s + aqk @ vnew).transpose(0, 1)
        glast = gc[:, -1:, :]  # [HV, 1, K]
        s = s * glast.transpose(1, 2).exp() + ((glast - gc).exp() * kc).transpose(1, 2) @ vnew
    return out, s


def chunk_kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same map as :func:`recurrent_kda_reference`, computed chunk by chunk."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale)
    b, t, hv, dk = k.shape
    dv = v.shape[-1]
    seqs = _sequences(t, b, cu_seqlens)
    o = torch.zeros(b, t, hv, dv)
    final = torch.zeros(len(seqs), hv, dk, dv)
    for n, (bi, start, end) in enumerate(seqs):
        s = torch.zeros(hv, dk, dv) if initial_state is None else initial_state[n].float().clone()
        sl = slice(start, end)
        o[bi, sl], final[n] = _chunk_one(q[bi, sl], k[bi, sl], v[bi, sl], g[bi, sl], beta[bi, sl], s, chunk_size)
    return o, final


def short_conv_reference(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution then SiLU, as applied to q, k and v in a KDA layer.

    x: ``[B, T, D]``; weight: ``[D, W]`` (W = 4 in K3); conv_state: ``[B, D, W - 1]``, the
    previous W - 1 inputs (zeros at the start of a sequence). Returns (y ``[B, T, D]``, the new
    conv state ``[B, D, W - 1]``) so a decode step (T = 1) continues a prefill exactly.
    """
    bsz, t, d = x.shape
    w = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(bsz, d, w - 1)
    full = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=2)  # [B, D, W-1+T]
    y = F.conv1d(full.float(), weight.float()[:, None, :], groups=d)  # [B, D, T]
    return F.silu(y).transpose(1, 2).to(x.dtype), full[:, :, -(w - 1):].clone()


def gated_rms_norm_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """KDA output norm: RMSNorm(x) * weight * sigmoid(gate), over the last dim (head dim V)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)
