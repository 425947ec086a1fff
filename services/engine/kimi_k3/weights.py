"""Crescent's internal tensor names and shapes of a kimi_k3 model, and seeded random weights
(the nano preset).

Names follow Hugging Face conventions (``model.layers.{i}.self_attn.q_proj.weight``, linear
weights stored ``[out, in]``). Fused expert tensors are ``[experts, out, in]``, as MXFP4
checkpoints store them. Per layer, ``attn_res``/``mlp_res`` hold the Block AttnRes pseudo-query
and key norm of the layer's two sublayers; ``mlp.gate.e_score_correction_bias`` holds the
router's per-expert selection offsets. Which tensors exist follows the config (a full-rank or
low-rank KDA output gate, the MLA gate, AttnRes, the latent projections and norm). Real
Moonshot checkpoints use other names; ``real_checkpoint.py`` maps them onto these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from crescent.services.engine.kimi_k3.config import K3Config

if TYPE_CHECKING:
    import torch  # imported by random_weights: the planner reads weight_shapes without torch


def weight_shapes(cfg: K3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``cfg`` holds, with its shape."""
    d = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        for sub in ("attn_res", "mlp_res") if cfg.attn_res else ():
            shapes[p + f"{sub}.query"] = (d,)
            shapes[p + f"{sub}.norm.weight"] = (d,)
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes.update(_kda_shapes(cfg, p + "self_attn.") if kind == "kda" else _mla_shapes(cfg, p + "self_attn."))
        shapes.update(_moe_shapes(cfg, p + "mlp.") if cfg.is_moe_layer(i) else _dense_shapes(cfg, p + "mlp."))
    if cfg.attn_res:
        shapes["model.final_res.query"] = (d,)
        shapes["model.final_res.norm.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def _kda_shapes(cfg: K3Config, p: str) -> dict[str, tuple[int, ...]]:
    d, r, w = cfg.hidden_size, cfg.kda_gate_rank, cfg.kda_conv_width
    qk, v, hv = cfg.kda_qk_dim, cfg.kda_v_dim, cfg.kda_num_v_heads
    shapes = {
        p + "q_proj.weight": (qk, d), p + "k_proj.weight": (qk, d), p + "v_proj.weight": (v, d),
        p + "q_conv1d.weight": (qk, w), p + "k_conv1d.weight": (qk, w), p + "v_conv1d.weight": (v, w),
        p + "f_a_proj.weight": (r, d), p + "f_b_proj.weight": (hv * cfg.kda_head_dim, r),
        p + "A_log": (hv,), p + "dt_bias": (hv * cfg.kda_head_dim,), p + "b_proj.weight": (hv, d),
        p + "o_norm.weight": (cfg.kda_v_head_dim,), p + "o_proj.weight": (d, v),
    }
    if cfg.kda_full_rank_output_gate:
        shapes[p + "g_proj.weight"] = (v, d)
    else:
        shapes[p + "g_a_proj.weight"] = (r, d)
        shapes[p + "g_b_proj.weight"] = (v, r)
    return shapes


def _mla_shapes(cfg: K3Config, p: str) -> dict[str, tuple[int, ...]]:
    d, h = cfg.hidden_size, cfg.mla_num_heads
    q_out = h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.q_lora_rank:
        shapes[p + "q_a_proj.weight"] = (cfg.q_lora_rank, d)
        shapes[p + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes[p + "q_b_proj.weight"] = (q_out, cfg.q_lora_rank)
    else:
        shapes[p + "q_proj.weight"] = (q_out, d)
    shapes[p + "kv_a_proj_with_mqa.weight"] = (cfg.mla_latent_dim, d)
    shapes[p + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    shapes[p + "kv_b_proj.weight"] = (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    if cfg.mla_output_gate:
        shapes[p + "g_proj.weight"] = (h * cfg.v_head_dim, d)
    shapes[p + "o_proj.weight"] = (d, h * cfg.v_head_dim)
    return shapes


def _dense_shapes(cfg: K3Config, p: str) -> dict[str, tuple[int, ...]]:
    d, f = cfg.hidden_size, cfg.dense_intermediate_size
    return {p + "gate_proj.weight": (f, d), p + "up_proj.weight": (f, d), p + "down_proj.weight": (d, f)}


def _moe_shapes(cfg: K3Config, p: str) -> dict[str, tuple[int, ...]]:
    d, lat, e, f = cfg.hidden_size, cfg.expert_input_size, cfg.num_experts, cfg.moe_intermediate_size
    s, fs = cfg.num_shared_experts, cfg.shared_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        p + "gate.weight": (e, d), p + "gate.e_score_correction_bias": (e,),
        p + "experts.gate_up_proj": (e, 2 * f, lat), p + "experts.down_proj": (e, lat, f),
    }
    if cfg.moe_latent_size:
        shapes[p + "latent_down.weight"] = (lat, d)
        shapes[p + "latent_up.weight"] = (d, lat)
    if cfg.moe_latent_norm:
        shapes[p + "latent_norm.weight"] = (lat,)
    if s:
        shapes[p + "shared_experts.gate_up_proj"] = (s, 2 * fs, d)
        shapes[p + "shared_experts.down_proj"] = (s, d, fs)
    return shapes


def random_weights(cfg: K3Config, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random weights: the same ``(cfg, seed)`` gives the same tensors everywhere.

    Router offsets start at zero; ``loading.balance_router_offsets`` derives them by quantile
    balancing, as a trained checkpoint's would be.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith(("dt_bias", ".query")):  # small: gentle decays, near-uniform AttnRes mixes
            t = 0.5 * torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        elif name.endswith("e_score_correction_bias"):
            t = torch.zeros(shape)
        else:  # projections [.., out, in], conv filters [channels, width], embedding rows
            t = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        weights[name] = t
    return weights
