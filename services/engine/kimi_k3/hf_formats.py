"""The real Moonshot config formats, translated into a ``K3Config``.

- ``model_type: "kimi_linear"`` — Kimi-Linear-48B-A3B's flat config (``linear_attn_config``,
  ``num_experts_per_token``, ``mla_use_nope``, ...); its tensors have no prefix.
- ``model_type: "kimi_k3"`` with a ``text_config`` — Kimi K3's nested config: the text model is
  a ``kimi_linear`` config (plus ``attn_res_block_size``, ``routed_expert_hidden_size``,
  ``latent_moe_use_norm``, ``hidden_act: "situ"``, ...) and ``vision_config`` describes the
  vision tower, which text-only serving skips; its text tensors are prefixed ``language_model.``.

Field semantics follow Moonshot's ``configuration_kimi*.py`` / ``modeling_kimi*.py`` (see
docs/k3.md for the table). Every field is either used, checked, listed as having no effect on
the text model's logits, or one of the generic fields transformers writes into every config
(``hf_config.GENERIC_FIELDS``, ignored by name); any other field, or a value Crescent cannot
compute, fails with a ``ModelConfigError`` naming it — a config the loader does not understand is
never guessed at. The context window is ``hf_config.context_window`` (the length keys vLLM reads).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from crescent.services.engine.kimi_k3.config import K3Config, MODEL_DTYPES
from crescent.services.engine.model_config import ModelConfigError
from crescent.services.model.hf_config import (
    GENERIC_FIELDS,
    LENGTH_KEYS,
    HfConfigError,
    check_generic,
    config_dtype,
    context_window,
)

KIMI_LINEAR = "kimi_linear"
KIMI_K3 = "kimi_k3"
# The MLA latent norms (q_a_layernorm, kv_a_layernorm) are built without an eps in the modeling
# code, so they keep the RMSNorm class default rather than rms_norm_eps.
MLA_LATENT_NORM_EPS = 1e-6

# Model-specific fields with no effect on the text model's logits (bookkeeping, training). The
# generic PretrainedConfig fields every transformers config carries (``hf_config.GENERIC_FIELDS``)
# and the length keys (``hf_config.LENGTH_KEYS``: the context window) are known everywhere.
_TEXT_IGNORED = {
    "auto_map", "initializer_range", "use_cache", "head_dim", "attention_dropout", "num_key_value_heads",
    "rope_theta", "rope_scaling", "rope_parameters", "use_grouped_topk", "num_nextn_predict_layers",
    "output_router_logits", "router_aux_loss_coef",
}
_TOP_IGNORED = {
    "auto_map", "ignore_index", "media_placeholder_token_id", "image_placeholder", "video_placeholder",
    "use_cache", "vocab_size", "hidden_size", "num_hidden_layers", "vision_config", "text_config",
    "quantization_config", "use_unified_vision_chunk", "video_placeholder_token_id",
}
_TEXT_USED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "hidden_act", "activation_situ_beta", "activation_situ_linear_beta", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "mla_use_nope", "mla_use_output_gate", "num_experts", "num_experts_per_token",
    "num_shared_experts", "moe_intermediate_size", "routed_expert_hidden_size",
    "latent_moe_use_norm", "moe_renormalize", "moe_router_activation_func", "topk_method",
    "num_expert_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace",
    "moe_layer_freq", "attn_res_block_size", "linear_attn_config", "quantization_config",
}
_LINEAR_ATTN_KEYS = {
    "kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size",
    "use_full_rank_gate", "gate_lower_bound",
}
MXFP4_FORMAT = "mxfp4-pack-quantized"


@dataclass(frozen=True, slots=True)
class RealFormat:
    """How a real checkpoint stores the text model: its name prefix and its MTP layers."""

    model_type: str
    prefix: str                 # "language_model." for kimi_k3, "" for kimi_linear
    nextn_layers: int           # trailing multi-token-prediction layers (skipped: no speculative decoding)
    compressed_mxfp4: bool      # quantization_config: compressed-tensors mxfp4-pack-quantized


def is_real_kimi_config(raw: Mapping[str, Any]) -> bool:
    """A real Moonshot config, as opposed to Crescent's own flat ``kimi_k3`` format."""
    return raw.get("model_type") == KIMI_LINEAR or (raw.get("model_type") == KIMI_K3 and "text_config" in raw)


def parse_real_config(raw: Mapping[str, Any], weights_dtype: str | None = None) -> tuple[K3Config, RealFormat]:
    """``weights_dtype``: the dtype the checkpoint's floating-point tensors are stored in, the
    model's dtype when the config states none (``loading.read_any_config`` reads it from the
    safetensors headers)."""
    if raw.get("model_type") == KIMI_LINEAR:
        text, where = raw, ""
    elif raw.get("model_type") == KIMI_K3 and isinstance(raw.get("text_config"), Mapping):
        _reject_unknown(raw, _TOP_IGNORED, "")
        text, where = raw["text_config"], "text_config."
        if text.get("model_type", KIMI_LINEAR) != KIMI_LINEAR:
            raise ModelConfigError(f"config.json text_config.model_type is {text.get('model_type')!r}, expected 'kimi_linear'")
    else:
        raise ModelConfigError(f"config.json model_type is {raw.get('model_type')!r}: expected 'kimi_linear', or 'kimi_k3' with a text_config")
    _reject_unknown(text, _TEXT_USED | _TEXT_IGNORED, where)
    quant = text.get("quantization_config", raw.get("quantization_config"))
    fmt = RealFormat(model_type=str(raw["model_type"]), prefix="language_model." if where else "",
                     nextn_layers=int(text.get("num_nextn_predict_layers") or 0),
                     compressed_mxfp4=_compressed_mxfp4(quant, where))
    return _text_config(text, where, raw, weights_dtype), fmt


def _reject_unknown(cfg: Mapping[str, Any], known: set[str], where: str) -> None:
    """A field neither the model's (``known``), nor generic, nor a length key is an error."""
    try:
        check_generic(cfg, where)
    except HfConfigError as exc:
        raise ModelConfigError(str(exc)) from None
    unknown = sorted(set(cfg) - known - GENERIC_FIELDS - set(LENGTH_KEYS))
    if unknown:
        more = f" (nor {', '.join(where + u for u in unknown[1:])})" if unknown[1:] else ""
        raise ModelConfigError(f"config.json field '{where}{unknown[0]}' is not understood by Crescent's kimi loader{more}")


def _compressed_mxfp4(quant: Any, where: str) -> bool:
    if quant is None:
        return False
    method, fmt = quant.get("quant_method"), quant.get("format")
    if method != "compressed-tensors":
        raise ModelConfigError(f"config.json {where}quantization_config.quant_method {method!r} is not supported "
                               "(only compressed-tensors)")
    if fmt != MXFP4_FORMAT:
        raise ModelConfigError(f"config.json {where}quantization_config.format {fmt!r} is not supported (only {MXFP4_FORMAT!r})")
    return True


def _cache_dtype(top: Mapping[str, Any], weights_dtype: str | None) -> str:
    """The model's dtype: the config's (``dtype``/``torch_dtype``, the text config's first), else
    the dtype the checkpoint's floating-point tensors are stored in (``weights_dtype``; bf16 for
    the public checkpoints), else float32. The cache keeps MLA latents and KDA conv tails in it."""
    stated = config_dtype(top)
    if stated is not None:
        value, key = stated
        # fp8 is a cache option (engine.kv_cache_dtype), never a model's dtype
        _check(value in MODEL_DTYPES, key, value, f"one of {', '.join(MODEL_DTYPES)}")
        return value
    return weights_dtype if weights_dtype in MODEL_DTYPES else "float32"


def _context_window(top: Mapping[str, Any]) -> int:
    try:
        return context_window(top)
    except HfConfigError as exc:
        raise ModelConfigError(str(exc)) from None


def _need(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if cfg.get(key) is None:
        raise ModelConfigError(f"config.json lacks {where}{key}")
    return cfg[key]


def _check(ok: bool, field: str, value: Any, expected: str) -> None:
    if not ok:
        raise ModelConfigError(f"config.json {field} = {value!r} is not supported: {expected}")


def _layer_types(la: Mapping[str, Any], n: int, where: str) -> tuple[str, ...]:
    """1-based ``kda_layers`` / ``full_attn_layers`` -> one "kda"/"mla" per layer."""
    kda = [int(i) for i in _need(la, "kda_layers", where)]
    full = [int(i) for i in la.get("full_attn_layers") or [i for i in range(1, n + 1) if i not in set(kda)]]
    _check(sorted(kda + full) == list(range(1, n + 1)), f"{where}kda_layers/full_attn_layers", (kda, full),
           f"together they must list layers 1..{n} once each (1-based)")
    return tuple("kda" if i + 1 in set(kda) else "mla" for i in range(n))


def _text_config(t: Mapping[str, Any], where: str, top: Mapping[str, Any], weights_dtype: str | None) -> K3Config:
    la_where = f"{where}linear_attn_config."
    la = _need(t, "linear_attn_config", where)
    _reject_unknown(la, _LINEAR_ATTN_KEYS, la_where)
    n = int(_need(t, "num_hidden_layers", where))
    hidden_act = t.get("hidden_act", "silu")
    _check(hidden_act in ("silu", "situ"), f"{where}hidden_act", hidden_act, "'silu' or 'situ'")
    _check(t.get("mla_use_nope") is True, f"{where}mla_use_nope", t.get("mla_use_nope"),
           "the Kimi modeling code only defines NoPE MLA (true)")
    _check(t.get("topk_method", "noaux_tc") == "noaux_tc", f"{where}topk_method", t.get("topk_method"), "'noaux_tc'")
    scoring = t.get("moe_router_activation_func", "sigmoid")
    _check(scoring in ("sigmoid", "softmax"), f"{where}moe_router_activation_func", scoring, "'sigmoid' or 'softmax'")
    experts = int(_need(t, "num_experts", where))
    top_k = int(_need(t, "num_experts_per_token", where))
    groups, topk_groups = int(t.get("num_expert_group") or 1), int(t.get("topk_group") or 1)
    if not (groups > 1 and groups > topk_groups):  # the modeling code groups only then
        groups = topk_groups = 1
    shared = int(t.get("num_shared_experts") or 0)
    moe_inter = int(_need(t, "moe_intermediate_size", where))
    latent = int(t.get("routed_expert_hidden_size") or 0)
    block = t.get("attn_res_block_size")
    heads, head_dim = int(_need(la, "num_heads", la_where)), int(_need(la, "head_dim", la_where))
    eos = t.get("eos_token_id", top.get("eos_token_id"))
    cache_dtype = _cache_dtype(top, weights_dtype)
    first_dense = int(t.get("first_k_dense_replace") or 0)
    return K3Config(
        vocab_size=int(_need(t, "vocab_size", where)), hidden_size=int(_need(t, "hidden_size", where)),
        layer_types=_layer_types(la, n, la_where), first_dense_layers=min(first_dense, n),
        dense_intermediate_size=int(_need(t, "intermediate_size", where)) if first_dense else 0,
        kda_num_heads=heads, kda_num_v_heads=heads, kda_head_dim=head_dim, kda_v_head_dim=head_dim,
        kda_gate_rank=head_dim, kda_conv_width=int(la.get("short_conv_kernel_size", 4)),
        kda_lower_bound=None if la.get("gate_lower_bound") is None else float(la["gate_lower_bound"]),
        mla_num_heads=int(_need(t, "num_attention_heads", where)), q_lora_rank=int(t.get("q_lora_rank") or 0),
        kv_lora_rank=int(_need(t, "kv_lora_rank", where)), qk_nope_head_dim=int(_need(t, "qk_nope_head_dim", where)),
        qk_rope_head_dim=int(_need(t, "qk_rope_head_dim", where)), v_head_dim=int(_need(t, "v_head_dim", where)),
        rope_theta=10000.0,  # unused: NoPE
        num_experts=experts, num_shared_experts=1 if shared else 0, num_experts_per_tok=top_k,
        moe_latent_size=latent, moe_intermediate_size=moe_inter, shared_intermediate_size=moe_inter * shared,
        routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0)),
        attn_res_blocks=math.ceil(n / int(block)) if block else 1,
        situ_beta_gate=float(t.get("activation_situ_beta") or 1.0),
        situ_beta_up=None if t.get("activation_situ_linear_beta") is None else float(t["activation_situ_linear_beta"]),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),  # the configuration class's default
        max_position_embeddings=_context_window(top),  # the length keys vLLM reads (hf_config)
        tie_word_embeddings=bool(t.get("tie_word_embeddings", top.get("tie_word_embeddings", False))),
        bos_token_id=t.get("bos_token_id", top.get("bos_token_id")),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        hidden_act=hidden_act, mla_rope=False, mla_output_gate=bool(t.get("mla_use_output_gate", False)),
        mla_norm_eps=MLA_LATENT_NORM_EPS, kda_full_rank_output_gate=bool(la.get("use_full_rank_gate", False)),
        attn_res=block is not None, attn_res_block_layers=int(block or 0),
        moe_latent_norm=bool(t.get("latent_moe_use_norm", False)) and latent > 0, moe_scoring=scoring,
        # the modeling code renormalises only when a token has more than one expert
        moe_renormalize=bool(t.get("moe_renormalize", True)) and top_k > 1,
        moe_num_groups=groups, moe_topk_groups=topk_groups, moe_layer_freq=int(t.get("moe_layer_freq") or 1),
        cache_dtype=cache_dtype,
    )
