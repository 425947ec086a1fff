"""A tiny Llama with seeded random weights, and a dense (unpaged) forward pass to check against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from crescent.services.engine.llama import LlamaModel
from crescent.services.engine.model_config import LlamaConfig

TINY = LlamaConfig(
    vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=512,
    tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(1,),
)


def tiny_weights(cfg: LlamaConfig = TINY, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in cfg.weight_shapes().items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            weights[name] = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    return weights


def tiny_model(seed: int = 0) -> LlamaModel:
    return LlamaModel(TINY, tiny_weights(TINY, seed))


def dense_logits(cfg: LlamaConfig, w: dict[str, torch.Tensor], token_ids: list[int]) -> torch.Tensor:
    """Logits at every position, computed the textbook way: no cache, no pages, no batching."""
    n = len(token_ids)
    h = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    pos = torch.arange(n, dtype=torch.float64)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    ang = torch.outer(pos, inv)
    cos, sin = ang.cos().float(), ang.sin().float()

    def rope(x: torch.Tensor) -> torch.Tensor:  # (n, heads, d), pairs (i, i + d/2)
        a, b = x[..., : cfg.head_dim // 2], x[..., cfg.head_dim // 2 :]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([a * c - b * s, a * s + b * c], dim=-1)

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight

    group = cfg.num_heads // cfg.num_kv_heads
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(n, cfg.num_heads, cfg.head_dim))
        k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(n, cfg.num_kv_heads, cfg.head_dim))
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, cfg.num_kv_heads, cfg.head_dim)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / cfg.head_dim**0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        h = h + (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return norm(h, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T
