"""What a load produces: the model's shape, its float32 weights and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crescent.services.engine.model_config import LlamaConfig
from crescent.services.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    """Weights are float32 CPU tensors in Hugging Face Llama names (see ``LlamaConfig.weight_shapes``).

    Q and K rows follow Hugging Face's rotate-half RoPE layout. ``lm_head.weight`` is present only
    when the output projection is not tied to the embedding.
    """

    config: LlamaConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    model_id: str
