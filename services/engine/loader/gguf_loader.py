"""Load a llama-architecture GGUF file into float32 tensors with Hugging Face names."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from crescent.services.engine.loader.dequant import dequantize, unpermute_qk
from crescent.services.engine.loader.errors import ModelLoadError
from crescent.services.engine.loader.loaded import LoadedModel
from crescent.services.engine.loader.progress import track
from crescent.services.engine.model_config import LlamaConfig, ModelConfigError
from crescent.services.model.tokenizer import Tokenizer, TokenizerError

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a GGUF tensor; ``ModelLoadError`` for unknown tensors."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not part of a plain Llama model")


def _meta(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: Any) -> float:
    # GGUF stores float32: take its shortest decimal form (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))


def config_from_gguf(reader: gguf.GGUFReader, tokenizer: Tokenizer) -> LlamaConfig:
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF general.architecture is {arch!r}; only 'llama' is supported")

    def need(key: str) -> Any:
        value = _meta(reader, f"llama.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF file lacks llama.{key}")
        return value

    scaling = _meta(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", ""):  # scaled RoPE would silently give wrong logits
        raise ModelLoadError(f"GGUF llama.rope.scaling.type {scaling!r} is not supported")
    if _meta(reader, "llama.expert_count", 0):
        raise ModelLoadError("GGUF llama.expert_count > 0: mixture-of-experts models are not supported")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(_meta(reader, "llama.attention.key_length", hidden // heads))
    rotary = int(_meta(reader, "llama.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ModelLoadError(
            f"GGUF llama.rope.dimension_count {rotary} != head dim {head_dim}: partial RoPE is not supported"
        )
    names = {t.name for t in reader.tensors}
    try:
        return LlamaConfig(
            vocab_size=int(_meta(reader, "llama.vocab_size", tokenizer.vocab_size)),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(_meta(reader, "llama.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=_f32(_meta(reader, "llama.rope.freq_base", 10000.0)),
            rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(need("context_length")),
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
        )
    except ModelConfigError as exc:
        raise ModelLoadError(f"GGUF metadata: {exc}") from exc


def load_gguf(path: Path, model_id: str, *, progress: bool) -> LoadedModel:
    """Parse the file once; build the tokenizer from its metadata and dequantize every tensor."""
    logger.info("reading GGUF %s", path)
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    try:
        tokenizer = Tokenizer.from_gguf_reader(reader)
    except TokenizerError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    config = config_from_gguf(reader, tokenizer)
    expected = config.weight_shapes()
    weights: dict[str, torch.Tensor] = {}
    tensors = track(reader.tensors, total=len(reader.tensors), description=f"Loading {model_id}", enabled=progress)
    for t in tensors:
        name = hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dimension first
        if expected.get(name) != shape:
            raise ModelLoadError(f"GGUF tensor {t.name!r} has shape {shape}, expected {expected.get(name)}")
        values = dequantize(t.name, t.data, t.tensor_type, shape)
        if name.endswith("q_proj.weight"):
            values = unpermute_qk(values, config.num_heads)
        elif name.endswith("k_proj.weight"):
            values = unpermute_qk(values, config.num_kv_heads)
        weights[name] = torch.from_numpy(values)
    missing = sorted(expected.keys() - weights.keys())
    if missing:
        raise ModelLoadError(f"GGUF file {path} lacks tensors: {', '.join(missing[:5])}")
    logger.info("loaded %s from %s (%d tensors)", model_id, path, len(weights))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, model_id=model_id)
