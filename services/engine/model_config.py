"""The shape of a Llama-family model, as the engine needs it.

One frozen dataclass, filled from GGUF metadata or a Hugging Face ``config.json`` by the
loader, and written back to ``config.json`` by the exporter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from crescent.services.model.hf_config import HfConfigError, check_generic, context_window


class ModelConfigError(ValueError):
    """A model configuration the engine cannot serve; the message names the field."""


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the engine expects, in Hugging Face Llama names, with its shape."""
        h, f = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "self_attn.q_proj.weight"] = (self.q_size, h)
            shapes[p + "self_attn.k_proj.weight"] = (self.kv_size, h)
            shapes[p + "self_attn.v_proj.weight"] = (self.kv_size, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            shapes[p + "mlp.gate_proj.weight"] = (f, h)
            shapes[p + "mlp.up_proj.weight"] = (f, h)
            shapes[p + "mlp.down_proj.weight"] = (h, f)
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> LlamaConfig:
        """Read a Hugging Face ``config.json`` (LlamaForCausalLM)."""
        model_type = cfg.get("model_type")
        if model_type != "llama":
            raise ModelConfigError(f"config.json model_type is {model_type!r}; only 'llama' is supported")
        if cfg.get("rope_scaling"):
            # The engine implements plain RoPE; scaled RoPE would silently give wrong logits.
            raise ModelConfigError(f"config.json rope_scaling {cfg['rope_scaling']!r} is not supported")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ModelConfigError("config.json attention_bias/mlp_bias are not supported")
        try:
            check_generic(cfg)
            window = context_window(cfg)  # the length keys vLLM reads; one window for every component
        except HfConfigError as exc:
            raise ModelConfigError(str(exc)) from None
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=window,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
                eos_token_ids=tuple(int(t) for t in eos_ids),
            )
        except KeyError as exc:
            raise ModelConfigError(f"config.json lacks required field {exc.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` that transformers and vLLM load as LlamaForCausalLM in float32."""
        ids = list(self.eos_token_ids)
        eos: int | list[int] | None = ids[0] if len(ids) == 1 else (ids or None)
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": "float32",
            "use_cache": True,
        }
