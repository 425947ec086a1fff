"""What a load produces: the model's shape, its weights (as stored: float32, bf16 or fp16) and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crescent.services.engine.model_config import LlamaConfig
from crescent.services.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    """Weights are CPU tensors in Hugging Face Llama names (see ``LlamaConfig.weight_shapes``), in
    the dtype the checkpoint stores them (a GGUF's are dequantized to float32); the model converts
    them to ``engine.dtype`` on ``engine.device``. ``torch_dtype`` is the checkpoint's declared
    dtype (config.json's ``torch_dtype``/``dtype``), None where it declares none (GGUF).

    Q and K rows follow Hugging Face's rotate-half RoPE layout. ``lm_head.weight`` is present only
    when the output projection is not tied to the embedding.
    """

    config: LlamaConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    model_id: str
    torch_dtype: torch.dtype | None = None
