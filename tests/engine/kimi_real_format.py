"""Tiny checkpoints in exactly the real Moonshot formats, written by the tests (never committed).

Two configs shaped like the public ones with the dimensions scaled down — ``kimi_k3`` (nested:
``text_config`` + ``vision_config``, routed experts in compressed-tensors MXFP4, vision tensors
beside the text ones) and ``kimi_linear`` (Kimi-Linear-48B-A3B's flat config, bf16) — and
random tensors under the real names and shapes, as Moonshot's modeling code declares them
(``language_model.`` prefix for K3, ``[C, 1, 4]`` convs, K3's ``A_log`` zero-padded to the head
dim, ``[1, 1, H, 1]`` for Kimi-Linear, per-expert ``w1/w2/w3``...).

Both are written the way transformers writes them (``hf_written``): every generic
``PretrainedConfig`` field at the top level and in the nested ``text_config``/``vision_config``.
Kimi-Linear's config names no ``max_position_embeddings`` (its MLA has no positions), only
``model_max_length: 1048576``, as the published one.

``reference_weights`` decodes the files' tensors independently of Crescent (its own E2M1 table
and nibble order: low nibble = even element, E8M0 scale 2^(s-127)) for the test reference.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.engine.hf_written import as_written, composite_as_written

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

K3_TEXT = {
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 7,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
    "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "mla_use_nope": True, "mla_use_output_gate": True,
    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 32, "latent_moe_use_norm": True, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "use_grouped_topk": True,
    "num_expert_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "attn_res_block_size": 2, "num_nextn_predict_layers": 0,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6], "full_attn_layers": [4, 7], "num_heads": 2, "head_dim": 16,
        "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0,
    },
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16",
}
K3_VISION = {"model_type": "kimi_k3_vision", "patch_size": 14, "vt_hidden_size": 32, "vt_num_hidden_layers": 1,
             "text_hidden_size": 64}
K3_CONFIG = composite_as_written({
    "model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
    "media_placeholder_token_id": 500, "pad_token_id": 0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*",
                   "re:.*block_sparse_moe\\.gate$", "re:.*_res_proj$", "re:vision_tower.*", "re:mm_projector.*"],
    },
}, K3_TEXT, K3_VISION)
KIMI_LINEAR_CONFIG = as_written({
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig"},
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 5,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "initializer_range": 0.02, "use_cache": True, "rope_theta": 10000.0,
    "rope_scaling": None, "tie_word_embeddings": False, "model_max_length": 1048576,
    "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "mla_use_nope": True, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
    "moe_intermediate_size": 32, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
    "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4], "num_heads": 2,
                           "head_dim": 16, "short_conv_kernel_size": 4},
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16",
})


def text_config(config: dict) -> dict:
    return config["text_config"] if "text_config" in config else config


def _is_kda(text: dict, i: int) -> bool:
    return i + 1 in text["linear_attn_config"]["kda_layers"]


def _rand(gen: torch.Generator, *shape: int, scale: float | None = None) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * (scale if scale is not None else shape[-1] ** -0.5)


def _packed_mxfp4(gen: torch.Generator, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """Random E2M1 codes and E8M0 scales in the compressed-tensors layout."""
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    exponent = 127 - 3 - round(0.5 * torch.log2(torch.tensor(float(cols))).item())  # |w| ~ cols^-1/2
    scales = torch.randint(exponent - 1, exponent + 2, (rows, cols // 32), generator=gen, dtype=torch.uint8)
    return {"weight_packed": codes[:, 0::2] | (codes[:, 1::2] << 4), "weight_scale": scales}


def real_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint of ``config``, under its real name (bf16, or packed uint8)."""
    gen = torch.Generator().manual_seed(seed)
    t = text_config(config)
    nested = "text_config" in config
    mxfp4 = "quantization_config" in config
    d, la = t["hidden_size"], t["linear_attn_config"]
    h, k = la["num_heads"], la["head_dim"]
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _rand(gen, t["vocab_size"], d, scale=1.0),
                                    "model.norm.weight": 1 + 0.1 * _rand(gen, d, scale=1.0),
                                    "lm_head.weight": _rand(gen, t["vocab_size"], d)}
    if t.get("attn_res_block_size"):
        out["model.output_attn_res_proj.weight"] = _rand(gen, 1, d, scale=0.3)
        out["model.output_attn_res_norm.weight"] = 1 + 0.1 * _rand(gen, d, scale=1.0)
    for i in range(t["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = 1 + 0.1 * _rand(gen, d, scale=1.0)
        out[p + "post_attention_layernorm.weight"] = 1 + 0.1 * _rand(gen, d, scale=1.0)
        if t.get("attn_res_block_size"):
            for s in ("self_attention_res", "mlp_res"):
                out[p + f"{s}_proj.weight"] = _rand(gen, 1, d, scale=0.3)
                out[p + f"{s}_norm.weight"] = 1 + 0.1 * _rand(gen, d, scale=1.0)
        a = p + "self_attn."
        if _is_kda(t, i):
            for n in "qkv":
                out[a + f"{n}_proj.weight"] = _rand(gen, h * k, d)
                out[a + f"{n}_conv1d.weight"] = _rand(gen, h * k, 1, la["short_conv_kernel_size"], scale=0.5)
            out[a + "f_a_proj.weight"], out[a + "f_b_proj.weight"] = _rand(gen, k, d), _rand(gen, h * k, k)
            out[a + "b_proj.weight"] = _rand(gen, h, d)
            out[a + "dt_bias"] = _rand(gen, h * k, scale=0.5)
            a_log = torch.empty(h).uniform_(1, 16, generator=gen).log()
            # K3 stores the per-head rates zero-padded to the head dim; Kimi-Linear as [1, 1, H, 1]
            out[a + "A_log"] = torch.cat([a_log, torch.zeros(k - h)]) if nested else a_log.view(1, 1, h, 1)
            if la.get("use_full_rank_gate"):
                out[a + "g_proj.weight"] = _rand(gen, h * k, d)
            else:
                out[a + "g_a_proj.weight"], out[a + "g_b_proj.weight"] = _rand(gen, k, d), _rand(gen, h * k, k)
            out[a + "o_norm.weight"] = 1 + 0.1 * _rand(gen, k, scale=1.0)
            out[a + "o_proj.weight"] = _rand(gen, d, h * k)
        else:
            heads, dn, dr, dv, dc = (t["num_attention_heads"], t["qk_nope_head_dim"], t["qk_rope_head_dim"],
                                     t["v_head_dim"], t["kv_lora_rank"])
            if t.get("q_lora_rank"):
                out[a + "q_a_proj.weight"] = _rand(gen, t["q_lora_rank"], d)
                out[a + "q_a_layernorm.weight"] = 1 + 0.1 * _rand(gen, t["q_lora_rank"], scale=1.0)
                out[a + "q_b_proj.weight"] = _rand(gen, heads * (dn + dr), t["q_lora_rank"])
            else:
                out[a + "q_proj.weight"] = _rand(gen, heads * (dn + dr), d)
            out[a + "kv_a_proj_with_mqa.weight"] = _rand(gen, dc + dr, d)
            out[a + "kv_a_layernorm.weight"] = 1 + 0.1 * _rand(gen, dc, scale=1.0)
            out[a + "kv_b_proj.weight"] = _rand(gen, heads * (dn + dv), dc)
            if t.get("mla_use_output_gate"):
                out[a + "g_proj.weight"] = _rand(gen, heads * dv, d)
            out[a + "o_proj.weight"] = _rand(gen, d, heads * dv)
        if i < t["first_k_dense_replace"]:
            f = t["intermediate_size"]
            out.update({p + "mlp.gate_proj.weight": _rand(gen, f, d), p + "mlp.up_proj.weight": _rand(gen, f, d),
                        p + "mlp.down_proj.weight": _rand(gen, d, f)})
            continue
        m = p + "block_sparse_moe."
        e, f, lat = t["num_experts"], t["moe_intermediate_size"], t.get("routed_expert_hidden_size") or d
        out[m + "gate.weight"] = _rand(gen, e, d)
        out[m + "gate.e_score_correction_bias"] = _rand(gen, e, scale=0.05)
        if t.get("routed_expert_hidden_size"):
            # Linear layers the quantization_config's ignore list leaves quantized, as K3 stores them
            for name, (rows, cols) in (("routed_expert_down_proj.", (lat, d)), ("routed_expert_up_proj.", (d, lat))):
                if mxfp4:
                    out.update({m + name + part: v for part, v in _packed_mxfp4(gen, rows, cols).items()})
                else:
                    out[m + name + "weight"] = _rand(gen, rows, cols)
            if t.get("latent_moe_use_norm"):
                out[m + "routed_expert_norm.weight"] = 1 + 0.1 * _rand(gen, lat, scale=1.0)
        for x in range(e):
            for w, (rows, cols) in (("w1", (f, lat)), ("w3", (f, lat)), ("w2", (lat, f))):
                name = m + f"experts.{x}.{w}."
                if mxfp4:
                    out.update({name + part: v for part, v in _packed_mxfp4(gen, rows, cols).items()})
                else:
                    out[name + "weight"] = _rand(gen, rows, cols)
        fs = f * t["num_shared_experts"]
        out.update({m + "shared_experts.gate_proj.weight": _rand(gen, fs, d),
                    m + "shared_experts.up_proj.weight": _rand(gen, fs, d),
                    m + "shared_experts.down_proj.weight": _rand(gen, d, fs)})
    out = {n: (v if v.dtype == torch.uint8 or n.endswith(("A_log", "dt_bias")) else v.bfloat16()) for n, v in out.items()}
    if nested:  # the text model under language_model., beside the vision tower and projector
        out = {"language_model." + n: v for n, v in out.items()}
        out["vision_tower.patch_embed.proj.weight"] = _rand(gen, 32, 3, 14, 14).bfloat16()
        out["mm_projector.proj.0.weight"] = _rand(gen, 64, 32 * 4).bfloat16()
    return out


def write_checkpoint(path: Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 2) -> Path:
    """config.json + sharded safetensors + model.safetensors.index.json, as published."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    names, weight_map = sorted(tensors), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}), encoding="utf-8")
    return path


def reference_weights(path: Path) -> dict[str, torch.Tensor]:
    """The text model's tensors read back from the files, fp32, MXFP4 decoded here, prefix dropped."""
    raw: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        raw.update(load_file(str(file)))
    table = torch.tensor(E2M1 + [-v for v in E2M1])  # code = sign bit 3 | magnitude index
    prefix = "language_model." if "text_config" in json.loads((path / "config.json").read_text()) else ""
    out = {}
    for name, t in raw.items():
        if not name.startswith(prefix) or name.endswith("weight_scale"):
            continue
        if name.endswith("weight_packed"):
            codes = torch.stack([t & 0x0F, t >> 4], dim=-1).reshape(t.shape[0], -1).long()  # low nibble first
            scale = torch.exp2(raw[name.replace("_packed", "_scale")].float() - 127)
            t = table[codes] * scale.repeat_interleave(32, dim=1)
        out[name.removeprefix(prefix).replace(".weight_packed", ".weight")] = t.float()
    return out


def with_changes(config: dict, text: dict | None = None, **top) -> dict:
    """A deep copy of ``config`` with some text-config (or top-level) fields changed."""
    out = copy.deepcopy(config)
    text_config(out).update(text or {})
    out.update(top)
    return out
