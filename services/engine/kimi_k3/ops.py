"""The kernel switch of the kimi_k3 model: fp32 PyTorch references or Triton kernels.

``select_backend(device)`` picks Triton on CUDA and the references elsewhere: the Triton CPU
interpreter is far too slow to serve with, and the kernels refuse CPU tensors without it. The
choice is explicit (``K3Ops(OpsBackend.TRITON)`` under ``TRITON_INTERPRET=1`` runs the kernels on
CPU, which is how tests/engine/test_kimi_k3.py checks that both backends compute the same ops).

Every reference op computes a token's (or a sequence's) result from that token (sequence) alone,
so a decode step gives bitwise the same result whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import partial

import torch

from crescent.kernels.cpu import batch_invariant_linear, rms_norm
from crescent.kernels.mxfp4.packed import Mxfp4Tensor

Act = Callable[[torch.Tensor], torch.Tensor]


class OpsBackend(Enum):
    REFERENCE = "reference"
    TRITON = "triton"


def select_backend(device: torch.device | str) -> OpsBackend:
    return OpsBackend.TRITON if torch.device(device).type == "cuda" else OpsBackend.REFERENCE


_VECTOR_CHUNK = 64  # floats; a multiple of what PyTorch's vectorised CPU loops take per step


def pointwise(fn: Act, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, computed so that each element's result does not depend
    on the tensor's size: PyTorch's CPU loops run whole vector steps with SLEEF (exp, tanh,
    sigmoid...) and leave a short tail to scalar libm, whose last bit can differ. Padding to whole
    steps keeps every element on the vector path, so a decode row is the same in any batch."""
    if x.device.type != "cpu":
        return fn(x)
    n = x.numel()
    flat = x.reshape(-1)
    if n % _VECTOR_CHUNK:
        flat = torch.cat([flat, flat.new_zeros(_VECTOR_CHUNK - n % _VECTOR_CHUNK)])
    return fn(flat)[:n].view(x.shape)


def situ_glu(gate_up: torch.Tensor, beta_gate: float = 4.0, beta_up: float | None = 25.0) -> torch.Tensor:
    """SiTU-GLU over ``[..., 2F]`` = [gate | up] -> ``[..., F]``:
    ``beta_g·tanh(G/beta_g)·sigmoid(G) · beta_u·tanh(U/beta_u)`` (Kimi K3 report, eq. 12); with
    ``beta_up`` None the up projection is not capped (``activation_situ_linear_beta`` unset)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if beta_up is not None:
        up = beta_up * torch.tanh(up / beta_up)
    return beta_gate * torch.tanh(gate / beta_gate) * torch.sigmoid(gate) * up


def mlp_activation(hidden_act: str, beta_gate: float, beta_up: float | None) -> Act:
    """The GLU every MLP of a model applies to ``[gate | up]``: SiTU-GLU or SwiGLU (``silu``)."""
    if hidden_act == "silu":
        from crescent.kernels.cpu import silu_and_mul

        return silu_and_mul
    return partial(situ_glu, beta_gate=beta_gate, beta_up=beta_up)


def kda_prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise q, k ``[N, H, K]`` (the kernels' eps), scale q, repeat to the value heads."""
    from crescent.kernels.kda.reference import l2_normalize

    rep = num_v_heads // q.shape[-2]
    return (l2_normalize(q.float()) * scale).repeat_interleave(rep, dim=-2), l2_normalize(k.float()).repeat_interleave(rep, dim=-2)


def kda_step_reference(q, k, v, g, beta, states: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One delta-rule step for N independent sequences: q,k ``[N,H,K]``, v ``[N,HV,V]``,
    g ``[N,HV,K]``, beta ``[N,HV]``, states ``[N,HV,K,V]`` -> (o ``[N,HV,V]``, new states)."""
    q, k = kda_prepare(q, k, v.shape[-2], scale)
    s = states * g.float().exp()[..., None]
    err = v.float() - (k[..., None] * s).sum(-2)
    s = s + k[..., None] * (beta.float()[..., None] * err)[..., None, :]
    return (q[..., None] * s).sum(-2), s


@dataclass(frozen=True, slots=True)
class K3Ops:
    backend: OpsBackend

    def kda_segment(self, q, k, v, g, beta, state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """KDA over ``T`` consecutive tokens of one sequence from ``state`` ``[HV,K,V]``:
        q,k ``[T,H,K]``, v ``[T,HV,V]``, g ``[T,HV,K]``, beta ``[T,HV]`` -> (o ``[T,HV,V]``, state)."""
        if q.shape[0] == 1:
            o, s = self.kda_step(q, k, v, g, beta, state[None], scale)
            return o, s[0]
        if self.backend is OpsBackend.TRITON:
            from crescent.kernels.kda import chunk_kda

            o, s = chunk_kda(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                             initial_state=state[None].contiguous(), output_final_state=True)
            return o[0], s[0]
        from crescent.kernels.kda.reference import chunk_kda_reference

        o, s = chunk_kda_reference(q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=state[None])
        return o[0], s[0]

    def kda_step_pooled(self, q, k, v, g, beta, pool: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
        """One decode token for each of N sequences whose states are rows ``rows`` (distinct) of
        ``pool`` ``[P,HV,K,V]`` fp32, updated in place; returns o ``[N,HV,V]``. The Triton kernel
        reads and writes the rows where they are; the reference gathers and scatters them."""
        if self.backend is OpsBackend.TRITON:
            from crescent.kernels.kda import kda_decode

            return kda_decode(q, k, v, g, beta, pool, scale=scale, state_indices=rows)
        o, pool[rows] = kda_step_reference(q, k, v, g, beta, pool[rows], scale)
        return o

    def kda_step(self, q, k, v, g, beta, states: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode token for each of N sequences; states ``[N,HV,K,V]`` (not modified)."""
        if self.backend is OpsBackend.TRITON:
            from crescent.kernels.kda import kda_decode

            new = states.float().contiguous().clone()
            return kda_decode(q, k, v, g, beta, new, scale=scale), new
        return kda_step_reference(q, k, v, g, beta, states, scale)

    def mla_attention(self, q_lat, q_rope, cache, block_table, seq_lens, cu_q, scale: float) -> torch.Tensor:
        """Absorbed causal latent attention over a paged cache ``[P, S, Dc+Dr]``: see
        ``crescent.kernels.mla``. Returns o_lat ``[Tq, H, Dc]``."""
        if self.backend is OpsBackend.TRITON:
            from crescent.kernels.mla import mla_paged_attention

            return mla_paged_attention(q_lat, q_rope, cache, block_table, seq_lens, cu_q, scale=scale)
        page, dc = cache.shape[1], q_lat.shape[-1]
        out = torch.empty_like(q_lat)
        for i, (length, a, b) in enumerate(zip(seq_lens.tolist(), cu_q[:-1].tolist(), cu_q[1:].tolist())):
            lat = cache[block_table[i, : -(-length // page)]].reshape(-1, cache.shape[-1])[:length].float()
            scores = torch.einsum("thc,lc->htl", q_lat[a:b].float(), lat[:, :dc])
            scores = scores + torch.einsum("thr,lr->htl", q_rope[a:b].float(), lat[:, dc:])
            pos = torch.arange(length - (b - a), length)[:, None]
            scores = scores.masked_fill(torch.arange(length)[None, :] > pos, float("-inf")) * scale
            out[a:b] = torch.einsum("htl,lc->thc", scores.softmax(-1), lat[:, :dc]).to(out.dtype)
        return out

    def expert_weights(self, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Checkpoint expert tensors (``[E, 2F, L]``, ``[E, L, F]``, i.e. [out, in]) in the layout
        :meth:`moe_routed` of this backend takes: as they are for the reference (contiguous linear
        weights keep rows batch-invariant), ``[E, in, out]`` for the grouped-matmul kernel; packed
        MXFP4 experts (``Mxfp4Tensor``) stay packed on both."""
        def layout(w):
            if isinstance(w, Mxfp4Tensor) or self.backend is OpsBackend.REFERENCE:
                return w.contiguous()
            return w.transpose(1, 2).contiguous()

        return layout(gate_up), layout(down)

    def moe_routed(self, x, weights, ids, w_gate_up, w_down, act: Act) -> torch.Tensor:
        """Routed experts: x ``[T, L]``, routing (weights, ids) ``[T, k]``, expert weights from
        :meth:`expert_weights` -> ``[T, L]`` = sum over a token's k experts of weight · expert(x)."""
        t, top_k = ids.shape
        e = w_gate_up.shape[0]
        if self.backend is OpsBackend.TRITON:
            # sorted by expert on the device: no host read of the routing (one launch per projection)
            flat = ids.flatten()
            order = torch.argsort(flat, stable=True)
            offsets = torch.zeros(e + 1, dtype=torch.int64, device=x.device)
            offsets[1:] = expert_counts(flat, e).cumsum(0)
            h = act(_grouped(x[order // top_k], w_gate_up, offsets))
            per_slot = torch.empty(t * top_k, x.shape[1], dtype=torch.float32, device=x.device)
            per_slot[order] = _grouped(h.to(x.dtype).contiguous(), w_down, offsets).float()
            return (per_slot.view(t, top_k, -1) * weights[..., None]).sum(1)
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        for expert in torch.unique(ids).tolist():  # ascending: a token sums its experts in id order
            tok, slot = (ids == expert).nonzero(as_tuple=True)
            h = act(self.expert_linear(x[tok], w_gate_up[expert]))
            out.index_add_(0, tok, self.expert_linear(h, w_down[expert]).float() * weights[tok, slot, None])
        return out

    def expert_linear(self, x: torch.Tensor, w: torch.Tensor | Mxfp4Tensor) -> torch.Tensor:
        """``x @ wᵀ`` for one expert's weight, float or packed MXFP4. Packed: the Triton
        ``mxfp4_matmul`` decodes blocks in registers; the reference dequantizes this one expert for
        the call and drops it (the same fp32 weight as at load, so the same bits as dequantized)."""
        if not isinstance(w, Mxfp4Tensor):
            return batch_invariant_linear(x, w)
        if self.backend is OpsBackend.TRITON:
            from crescent.kernels.mxfp4 import mxfp4_matmul

            return mxfp4_matmul(x.contiguous(), w.blocks, w.scales)
        return batch_invariant_linear(x, w.dequantize())

    def attn_res(self, sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Block AttnRes mix over ``[N, T, D]`` sources -> ``[T, D]``."""
        if sources.shape[0] == 1:
            return sources[0]  # softmax over one source is 1
        if self.backend is OpsBackend.TRITON:
            from crescent.kernels.attnres import block_attn_res

            return block_attn_res(sources, query, norm_weight, eps)
        # the reference's math with row-wise reductions only (no GEMV), so rows are batch-invariant
        v = sources.float()
        keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
        # softmax over the sources, one contiguous row per token (a row-wise kernel)
        mix = torch.softmax((keys * query.float()).sum(-1).t().contiguous(), dim=-1).t()
        return (mix[..., None] * v).sum(0).to(sources.dtype)


def to_device(values: torch.Tensor | list[int], device: torch.device | str) -> torch.Tensor:
    """Host indices or metadata onto ``device`` without waiting: on CUDA through pinned memory,
    asynchronously (a pageable copy synchronises the stream); elsewhere as they are."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
    kind = torch.device(device).type
    if kind == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if kind == "cpu" else t.to(device)


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert ``[E]`` int64 from expert ids, on their device. Not ``torch.bincount``:
    on CUDA it reads the largest id back to the host to size its output."""
    flat = ids.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


def _grouped(x: torch.Tensor, w: torch.Tensor | Mxfp4Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows sorted by expert times their expert's weight: dense ``[E, in, out]`` or packed MXFP4."""
    if isinstance(w, Mxfp4Tensor):
        from crescent.kernels.mxfp4.grouped import grouped_mxfp4_matmul

        return grouped_mxfp4_matmul(x, w.blocks, w.scales, offsets)
    from crescent.kernels.moe import grouped_matmul

    return grouped_matmul(x, w, offsets)


def head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per head ``x[:, h] @ weight[h].T``: x ``[N, H, I]``, weight ``[H, O, I]`` -> ``[N, H, O]``.
    One batch-invariant linear per head (a batched cuBLAS matmul picks its kernel by N, so a
    row's bits would depend on the batch): H launches, no host sync."""
    return torch.stack([linear(x[:, i], weight[i]) for i in range(weight.shape[0])], dim=1)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with its statistics in fp32 whatever x's dtype (a bf16 mean of squares loses the
    low bits of every row), the result in x's dtype."""
    if x.dtype == torch.float32:
        return rms_norm(x, weight, eps)
    return rms_norm(x.float(), weight.float(), eps).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with each row's result independent of the batch (see kernels.cpu)."""
    return batch_invariant_linear(x, weight)
