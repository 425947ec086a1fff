"""A gated Multi-head Latent Attention layer over the K3 cache's paged latents.

Per token the cache keeps only the normalised latent c_kv (``kv_lora_rank``) and the decoupled
key (``qk_rope_head_dim``); attention runs in absorbed form (``crescent.kernels.mla``):
queries are mapped into the latent space per head, and head outputs are expanded back by W_uv,
then (``mla_output_gate``) gated by ``sigmoid(g_proj(x))`` per element before the output
projection. With ``mla_rope`` off (NoPE: both real Kimi formats) the decoupled query and key
parts take part in the scores unrotated, as in Moonshot's modeling code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crescent.kernels.cpu import apply_rope
from crescent.services.engine.kimi_k3.cache import K3Cache
from crescent.services.engine.kimi_k3.config import K3Config
from crescent.services.engine.kimi_k3.ops import K3Ops, head_linear, linear, norm, pointwise
from crescent.services.engine.llama import ForwardBatch


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE tables for these positions only (a 1M-token table would not fit)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim))
    angles = torch.outer(positions.to(torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return pointwise(torch.cos, angles).float(), pointwise(torch.sin, angles).float()


@dataclass(frozen=True, slots=True)
class MlaWeights:
    q: torch.Tensor | None      # direct q projection, or None with the low-rank q path below
    q_a: torch.Tensor | None
    q_a_norm: torch.Tensor | None
    q_b: torch.Tensor | None
    kv_a: torch.Tensor
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor          # [H, Dc, Dn]: per head, the linear weight that absorbs q_nope
    w_uv_t: torch.Tensor        # [H, Dv, Dc]: per head, the linear weight that expands o_lat
    gate: torch.Tensor | None  # None: no output gate
    o: torch.Tensor

    @staticmethod
    def take(cfg: K3Config, w: dict[str, torch.Tensor], p: str) -> MlaWeights:
        h, dn, dv = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        kv_b = w[p + "kv_b_proj.weight"].view(h, dn + dv, cfg.kv_lora_rank)
        low_rank = cfg.q_lora_rank > 0
        return MlaWeights(
            q=None if low_rank else w[p + "q_proj.weight"],
            q_a=w[p + "q_a_proj.weight"] if low_rank else None,
            q_a_norm=w[p + "q_a_layernorm.weight"] if low_rank else None,
            q_b=w[p + "q_b_proj.weight"] if low_rank else None,
            kv_a=w[p + "kv_a_proj_with_mqa.weight"], kv_a_norm=w[p + "kv_a_layernorm.weight"],
            w_uk=kv_b[:, :dn, :].transpose(1, 2).contiguous(), w_uv_t=kv_b[:, dn:, :].contiguous(),
            gate=w[p + "g_proj.weight"] if cfg.mla_output_gate else None, o=w[p + "o_proj.weight"],
        )


class MlaLayer:
    def __init__(self, cfg: K3Config, weights: MlaWeights, slot: int, ops: K3Ops) -> None:
        self.cfg, self.w, self.slot, self.ops = cfg, weights, slot, ops  # slot: index among MLA layers
        self.scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: K3Cache) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        n, h, dn, dc = x.shape[0], cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        eps = cfg.mla_latent_norm_eps
        if w.q is not None:
            q = linear(x, w.q)
        else:
            q = linear(norm(linear(x, w.q_a), w.q_a_norm, eps), w.q_b)
        q = q.view(n, h, dn + cfg.qk_rope_head_dim)
        kv = linear(x, w.kv_a)
        c_kv = norm(kv[:, :dc], w.kv_a_norm, eps)
        q_nope, q_rope, k_rope = q[..., :dn], q[..., dn:], kv[:, dc:]
        step = cache.mla_step
        assert step is not None, "K3Cache.plan_forward runs before the layers"
        if cfg.mla_rope:
            cos, sin = rope_cos_sin(step.positions, cfg.qk_rope_head_dim, cfg.rope_theta)
            q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope[:, None], cos, sin)[:, 0]
        layer_cache = cache.latent[self.slot]
        layer_cache[step.slot_pages, step.slot_offsets] = cache.to_latent(torch.cat([c_kv, k_rope], dim=-1))

        q_lat = head_linear(q_nope, w.w_uk)
        o_lat = self.ops.mla_attention(q_lat.contiguous(), q_rope.contiguous(), layer_cache, step.block_table,
                                       step.seq_lens, step.cu_q, self.scale * cache.latent_scale)
        o = head_linear(o_lat * cache.latent_scale if cache.latent_scale != 1.0 else o_lat, w.w_uv_t)
        if w.gate is not None:
            o = o * pointwise(torch.sigmoid, linear(x, w.gate)).view(n, h, cfg.v_head_dim)
        return linear(o.reshape(n, -1), w.o)
