"""What a dense transformer with grouped-query attention needs on N GPUs (Qwen3-32B and its kind,
which vLLM serves and the native engine does not): the numbers behind ``crescent plan`` for them.

Weights: every parameter in the checkpoint's dtype (bf16: 2 bytes). Cache: K and V of every
layer and KV head for every token, in the same dtype. One engine instance on N GPUs runs tensor
parallel over all of them (``TP{N}``): each GPU holds 1/N of the weights and ``ceil(kv_heads/N)``
of the KV heads of every sequence (vLLM replicates a KV head when N exceeds their number).
Tensor parallelism needs N to divide the attention heads; a layout that does not is listed with no
sequences. Several instances of a node are separate pods (the chart's replicas), each placed by
the scheduler's cache-aware policy, rather than data-parallel ranks of one instance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from crescent.services.model.hf_config import context_window
from crescent.services.plan.capacity import LayoutPlan
from crescent.services.plan.gpus import GpuShape, PlanInputError

# model_type values of config.json read as a dense GQA transformer.
DENSE_TYPES = ("qwen3", "qwen2", "llama", "mistral")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True, slots=True)
class DenseConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool          # Qwen3: an RMSNorm of head_dim on q and on k in every layer
    attention_bias: bool   # Qwen2: biases on q, k and v
    dtype_bytes: int = 2

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> DenseConfig:
        model_type = cfg.get("model_type")
        if model_type not in DENSE_TYPES:
            raise PlanInputError(f"config.json model_type {model_type!r} is not a dense model plan reads "
                                 f"({', '.join(DENSE_TYPES)})")
        try:
            heads = int(cfg["num_attention_heads"])
            dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
            return cls(
                model_type=str(model_type), vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                max_position_embeddings=context_window(cfg),  # the length keys vLLM reads (hf_config)
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qk_norm=model_type == "qwen3",
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                dtype_bytes=DTYPE_BYTES.get(dtype, 2),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanInputError(f"config.json of a {model_type} model lacks or mangles {exc}") from None

    @property
    def params(self) -> int:
        """Embedding, LM head (unless tied), and per layer: q/k/v/o, the MLP's gate/up/down, two norms."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h
        layer += 2 * d if self.qk_norm else 0
        layer += q + 2 * kv if self.attention_bias else 0
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + h

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes


# Qwen/Qwen3-32B's config.json (32.76 B parameters, 64 layers, GQA 64/8, untied, bf16, 40,960
# positions; 32,768 native context).
QWEN3_32B = DenseConfig(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                        num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128,
                        max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True,
                        attention_bias=False)
DENSE_PRESETS = {"qwen3-32b": QWEN3_32B}


def dense_layouts(cfg: DenseConfig, context_tokens: int, gpus: int, gpu: GpuShape,
                  memory_utilization: float) -> list[LayoutPlan]:
    """Tensor parallel over the instance's GPUs: weights and KV heads split N ways."""
    n = gpus
    usable = int(gpu.memory_bytes * memory_utilization)
    weights = math.ceil(cfg.weight_bytes / n)
    heads_per_gpu = math.ceil(cfg.num_kv_heads / n)
    per_seq = context_tokens * cfg.kv_bytes_per_token * heads_per_gpu // cfg.num_kv_heads
    budget = usable - weights
    runs = cfg.num_heads % n == 0
    sequences = max(0, budget) // per_seq if runs and per_seq else 0
    name = f"TP{n}" if runs else f"TP{n} ({cfg.num_heads} heads do not split {n} ways)"
    return [LayoutPlan(name, weights, budget, per_seq, sequences, tensor_parallel=n)]


def dense_min_gpus(cfg: DenseConfig, context_tokens: int, gpu: GpuShape, memory_utilization: float,
                   limit: int = 1024) -> int | None:
    for n in range(1, limit + 1):
        if any(p.fits for p in dense_layouts(cfg, context_tokens, n, gpu, memory_utilization)):
            return n
    return None
