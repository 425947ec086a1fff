"""A Kimi Delta Attention layer over the K3 cache's per-block state snapshots.

Per token: q, k, v projections, each through a causal depthwise short convolution (width W,
SiLU); a per-channel decay from the low-rank f(x) — K3's lower-bounded
``g = lb·sigmoid(exp(A_log)·(f(x) + dt_bias))`` when the config has a ``kda_lower_bound``,
Kimi-Linear's ``g = -exp(A_log)·softplus(f(x) + dt_bias)`` when it has none;
``beta = sigmoid(b(x))``; the delta rule (``crescent.kernels.kda``); an output RMSNorm gated by
sigmoid of the output gate (one full-rank ``g_proj`` in K3, ``g_b(g_a(x))`` in Kimi-Linear and
Crescent's own presets); the output projection.

A sequence's new tokens are cut at block boundaries into segments. The first starts from the
sequence's live state (``K3Cache``: zeros, a resumed snapshot, a received state, or where its
last step left it); each boundary the cache's plan names keeps a snapshot; the last leaves the
live state. The conv tail is rounded to the cache dtype at every boundary, snapshot or not, so a
prefix hit, a chunked prefill and a single pass run the very same segments on the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from crescent.kernels.kda.reference import gated_rms_norm_reference, kda_gate, kda_softplus_gate, short_conv_reference
from crescent.services.engine.kimi_k3.cache import ChunkStates, K3Cache
from crescent.services.engine.kimi_k3.config import K3Config
from crescent.services.engine.kimi_k3.ops import K3Ops, linear, pointwise, to_device
from crescent.services.engine.llama import ForwardBatch


@dataclass(frozen=True, slots=True)
class KdaWeights:
    qkv: torch.Tensor      # q, k, v projections stacked [2·H·K + HV·V, D]
    conv: torch.Tensor     # q, k, v short-conv weights stacked [conv_dim, W]
    f_a: torch.Tensor
    f_b: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    b: torch.Tensor
    g: torch.Tensor | None    # full-rank output gate [HV·V, D], or None with the low-rank pair
    g_a: torch.Tensor | None
    g_b: torch.Tensor | None
    o_norm: torch.Tensor
    o: torch.Tensor

    @staticmethod
    def take(cfg: K3Config, w: dict[str, torch.Tensor], p: str) -> KdaWeights:
        full = cfg.kda_full_rank_output_gate
        return KdaWeights(
            qkv=torch.cat([w[p + f"{n}_proj.weight"] for n in "qkv"]).contiguous(),
            conv=torch.cat([w[p + f"{n}_conv1d.weight"] for n in "qkv"]).contiguous(),
            f_a=w[p + "f_a_proj.weight"], f_b=w[p + "f_b_proj.weight"], a_log=w[p + "A_log"],
            dt_bias=w[p + "dt_bias"], b=w[p + "b_proj.weight"], g=w[p + "g_proj.weight"] if full else None,
            g_a=None if full else w[p + "g_a_proj.weight"], g_b=None if full else w[p + "g_b_proj.weight"],
            o_norm=w[p + "o_norm.weight"], o=w[p + "o_proj.weight"],
        )


def conv_step(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the causal short conv + SiLU for N sequences: x ``[N, C]``, tail ``[N, C, W-1]``."""
    window = torch.cat([tail, x[:, :, None]], dim=2)
    return F.silu((window * weight).sum(-1)), window[:, :, 1:]


class KdaLayer:
    def __init__(self, cfg: K3Config, weights: KdaWeights, slot: int, ops: K3Ops) -> None:
        self.cfg, self.w, self.slot, self.ops = cfg, weights, slot, ops  # slot: index among KDA layers
        self.scale = cfg.kda_head_dim ** -0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: K3Cache) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        n = x.shape[0]
        hv, dk, dv = cfg.kda_num_v_heads, cfg.kda_head_dim, cfg.kda_v_head_dim
        mixed = linear(x, w.qkv)
        f = linear(linear(x, w.f_a), w.f_b).view(n, hv, dk)
        if cfg.kda_lower_bound is None:
            g = kda_softplus_gate(f, w.a_log, w.dt_bias)
        else:
            g = kda_gate(f, w.a_log, w.dt_bias, cfg.kda_lower_bound)
        beta = pointwise(torch.sigmoid, linear(x, w.b))
        out = x.new_empty((n, hv, dv))
        singles, start = [], 0
        for chunk, plan in zip(batch.chunks, cache.step, strict=True):
            first = chunk.context_len - chunk.num_new
            if chunk.num_new == 1:
                singles.append((start, chunk.context_len, plan))
            else:
                self._prefill(plan, first, chunk.context_len, slice(start, start + chunk.num_new),
                              mixed, g, beta, out, cache)
            start += chunk.num_new
        if singles:
            self._decode(singles, mixed, g, beta, out, cache)
        gate = (linear(x, w.g) if w.g is not None else linear(linear(x, w.g_a), w.g_b)).view(n, hv, dv)
        o = gated_rms_norm_reference(out, gate, w.o_norm, cfg.rms_norm_eps)
        return linear(o.reshape(n, hv * dv), w.o)

    def _split(self, y: torch.Tensor):
        cfg = self.cfg
        qk = cfg.kda_qk_dim
        lead = y.shape[:-1]
        q = y[..., :qk].reshape(*lead, cfg.kda_num_heads, cfg.kda_head_dim)
        k = y[..., qk : 2 * qk].reshape(*lead, cfg.kda_num_heads, cfg.kda_head_dim)
        v = y[..., 2 * qk :].reshape(*lead, cfg.kda_num_v_heads, cfg.kda_v_head_dim)
        return q, k, v

    def _decode(self, singles, mixed, g, beta, out, cache: K3Cache) -> None:
        """One token for each of several sequences, batched, on their rows of the cache's live
        state pool: the recurrent states are updated where they lie (``kda_step_pooled``)."""
        j, pool = self.slot, cache.live_pool
        rows = to_device([r for r, _, _ in singles], out.device)
        slots = to_device([plan.row for _, _, plan in singles], out.device)
        tails = pool.tail[j]
        y, tail = conv_step(mixed[rows], self.w.conv, tails[slots])
        q, k, v = self._split(y)
        o = self.ops.kda_step_pooled(q, k, v, g[rows], beta[rows], pool.state[j], slots, self.scale)
        out[rows] = o.to(out.dtype)
        bounds = [i for i, (_, end, _) in enumerate(singles) if end % cache.block_size == 0]
        if bounds:  # rounded at block boundaries only, as a prefill's segments are
            at = to_device(bounds, out.device)
            tail[at] = cache.round_tail(tail[at])
        tails[slots] = tail
        for i, (_, end, plan) in enumerate(singles):
            if end in plan.snapshots:
                self._snapshot(plan.snapshots[end], pool.state[j, plan.row], tail[i], cache)

    def _prefill(self, plan: ChunkStates, first: int, end: int, rows: slice, mixed, g, beta, out,
                 cache: K3Cache) -> None:
        """Tokens ``first .. end`` of one sequence, cut at block boundaries: each segment continues
        the state the previous one left, and a boundary the plan names keeps a snapshot of it."""
        ps, j = cache.block_size, self.slot
        state, tail = plan.live.state[0, j], plan.live.tail[0, j].float()
        a = first
        while a < end:
            b = min(end, (a // ps + 1) * ps)  # up to the next block boundary
            r = slice(rows.start + a - first, rows.start + b - first)
            if b - a == 1:
                y, new_tail = conv_step(mixed[r], self.w.conv, tail[None])
                tail = new_tail[0]
            else:
                y, tail = short_conv_reference(mixed[r][None], self.w.conv, tail[None])
                y, tail = y[0], tail[0]
            if b % ps == 0:
                tail = cache.round_tail(tail)
            q, k, v = self._split(y)
            o, state = self.ops.kda_segment(q, k, v, g[r], beta[r], state, self.scale)
            out[r] = o.to(out.dtype)
            if b in plan.snapshots and b < end:
                self._snapshot(plan.snapshots[b], state, tail, cache)
            a = b
        self._keep(plan, end, state, tail, cache)

    def _keep(self, plan: ChunkStates, end: int, state: torch.Tensor, tail: torch.Tensor, cache: K3Cache) -> None:
        """The state after token ``end - 1`` becomes the sequence's live state (and a snapshot
        when the plan wants one there)."""
        plan.live.state[0, self.slot] = state
        plan.live.tail[0, self.slot] = tail
        if end in plan.snapshots:
            self._snapshot(plan.snapshots[end], state, tail, cache)

    def _snapshot(self, slot: int, state: torch.Tensor, tail: torch.Tensor, cache: K3Cache) -> None:
        cache.snapshots.states.state[slot, self.slot] = state
        cache.snapshots.states.tail[slot, self.slot] = tail
