"""A textbook forward pass of kimi_k3 to test the engine against: whole sequence at once, no
cache, no pages, no segments — the token-by-token KDA recurrence and non-absorbed MLA."""

from __future__ import annotations

import dataclasses

import torch

from crescent.kernels.attnres.reference import block_attn_res_reference
from crescent.kernels.kda.reference import gated_rms_norm_reference, kda_gate, recurrent_kda_reference, short_conv_reference
from crescent.kernels.mla.reference import mla_attention_reference
from crescent.services.engine.kimi_k3.config import NANO, K3Config

TEST_CFG = dataclasses.replace(NANO, vocab_size=512, eos_token_ids=(1,))


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _situ(gate: torch.Tensor, up: torch.Tensor, cfg: K3Config) -> torch.Tensor:
    bg, bu = cfg.situ_beta_gate, cfg.situ_beta_up
    return bg * torch.tanh(gate / bg) * torch.sigmoid(gate) * bu * torch.tanh(up / bu)


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:  # (n, heads, d), pairs (i, i + d/2)
    n, d = x.shape[0], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    c, s = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1)


def _kda(cfg: K3Config, w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    n, h, hv, dk, dv = x.shape[0], cfg.kda_num_heads, cfg.kda_num_v_heads, cfg.kda_head_dim, cfg.kda_v_head_dim

    def conv(name: str) -> torch.Tensor:
        return short_conv_reference((x @ w[p + f"{name}_proj.weight"].T)[None], w[p + f"{name}_conv1d.weight"])[0][0]

    q, k, v = conv("q").view(n, h, dk), conv("k").view(n, h, dk), conv("v").view(n, hv, dv)
    f = (x @ w[p + "f_a_proj.weight"].T) @ w[p + "f_b_proj.weight"].T
    g = kda_gate(f.view(n, hv, dk), w[p + "A_log"], w[p + "dt_bias"], cfg.kda_lower_bound)
    beta = torch.sigmoid(x @ w[p + "b_proj.weight"].T)
    o, _ = recurrent_kda_reference(q[None], k[None], v[None], g[None], beta[None])
    gate = ((x @ w[p + "g_a_proj.weight"].T) @ w[p + "g_b_proj.weight"].T).view(n, hv, dv)
    return gated_rms_norm_reference(o[0], gate, w[p + "o_norm.weight"], cfg.rms_norm_eps).reshape(n, -1) @ w[p + "o_proj.weight"].T


def _mla(cfg: K3Config, w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    n, h, dn, dv, dc = x.shape[0], cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q = (x @ w[p + "q_proj.weight"].T).view(n, h, -1)
    kv = x @ w[p + "kv_a_proj_with_mqa.weight"].T
    c_kv = _norm(kv[:, :dc], w[p + "kv_a_layernorm.weight"], cfg.rms_norm_eps)
    k_rope = _rope(kv[:, None, dc:], cfg.rope_theta)[:, 0]
    kv_b = w[p + "kv_b_proj.weight"].view(h, dn + dv, dc)
    o = mla_attention_reference(q[..., :dn], _rope(q[..., dn:], cfg.rope_theta), c_kv, k_rope,
                                kv_b[:, :dn].transpose(1, 2), kv_b[:, dn:].transpose(1, 2),
                                (dn + cfg.qk_rope_head_dim) ** -0.5)
    o = o * torch.sigmoid(x @ w[p + "g_proj.weight"].T).view(n, h, dv)
    return o.reshape(n, -1) @ w[p + "o_proj.weight"].T


def _ffn(cfg: K3Config, w: dict, p: str, x: torch.Tensor, moe: bool) -> torch.Tensor:
    if not moe:
        return _situ(x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T, cfg) @ w[p + "down_proj.weight"].T
    scores = torch.sigmoid(x @ w[p + "gate.weight"].T)
    ids = torch.topk(scores + w[p + "gate.e_score_correction_bias"], cfg.num_experts_per_tok, dim=-1).indices
    chosen = scores.gather(-1, ids)
    weights = chosen / chosen.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    lat = x @ w[p + "latent_down.weight"].T
    routed = torch.zeros_like(lat)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = (lat[t] @ w[p + "experts.gate_up_proj"][ids[t, j]].T).chunk(2)
            routed[t] += weights[t, j] * (_situ(gate, up, cfg) @ w[p + "experts.down_proj"][ids[t, j]].T)
    out = routed @ w[p + "latent_up.weight"].T
    for s in range(w[p + "shared_experts.gate_up_proj"].shape[0]):
        gate, up = (x @ w[p + "shared_experts.gate_up_proj"][s].T).chunk(2, dim=-1)
        out = out + _situ(gate, up, cfg) @ w[p + "shared_experts.down_proj"][s].T
    return out


def dense_k3_logits(cfg: K3Config, w: dict[str, torch.Tensor], token_ids: list[int]) -> torch.Tensor:
    """Logits at every position ``(len(token_ids), vocab)``."""
    eps = cfg.rms_norm_eps
    blocks, partial, done = [w["model.embed_tokens.weight"][torch.tensor(token_ids)]], None, 0
    for index in range(2 * cfg.num_layers):
        layer, p = index // 2, f"model.layers.{index // 2}."
        res = p + ("attn_res." if index % 2 == 0 else "mlp_res.")
        sources = torch.stack(blocks + ([partial] if partial is not None else []))
        h = block_attn_res_reference(sources, w[res + "query"], w[res + "norm.weight"], eps)[0]
        if index % 2 == 0:
            x = _norm(h, w[p + "input_layernorm.weight"], eps)
            attn = _kda if cfg.layer_types[layer] == "kda" else _mla
            y = attn(cfg, w, p + "self_attn.", x)
        else:
            x = _norm(h, w[p + "post_attention_layernorm.weight"], eps)
            y = _ffn(cfg, w, p + "mlp.", x, cfg.is_moe_layer(layer))
        partial = y if partial is None else partial + y
        done += 1
        if done == cfg.sublayers_per_block:
            blocks, partial, done = blocks + [partial], None, 0
    sources = torch.stack(blocks + ([partial] if partial is not None else []))
    h = block_attn_res_reference(sources, w["model.final_res.query"], w["model.final_res.norm.weight"], eps)[0]
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    return _norm(h, w["model.norm.weight"], eps) @ head.T
