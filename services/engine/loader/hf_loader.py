"""Load a Llama-family Hugging Face directory: config.json, (sharded) safetensors, tokenizer.json."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from crescent.services.engine.device import checkpoint_dtype
from crescent.services.engine.loader.errors import ModelLoadError
from crescent.services.engine.loader.loaded import LoadedModel
from crescent.services.engine.loader.progress import track
from crescent.services.engine.model_config import LlamaConfig, ModelConfigError
from crescent.services.model.tokenizer import Tokenizer, TokenizerError

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_FILE = "model.safetensors.index.json"


def _read_config(path: Path) -> tuple[LlamaConfig, torch.dtype | None]:
    """The model's shape and its declared dtype (``torch_dtype``, or ``dtype`` in newer files)."""
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
        return LlamaConfig.from_hf_dict(raw), checkpoint_dtype(raw.get("torch_dtype") or raw.get("dtype"))
    except (OSError, ValueError) as exc:  # ModelConfigError is a ValueError
        raise ModelLoadError(f"{path / 'config.json'}: {exc}") from exc


def weight_files(path: Path) -> list[Path]:
    """The safetensors shards to read: those the index names, else every *.safetensors file."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"{index}: unreadable shard index ({exc!r})") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no *.safetensors files")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"shard {f.name} named in {INDEX_FILE} is missing")
    return files


def _ignored(name: str, config: LlamaConfig) -> bool:
    # Tied checkpoints sometimes still store lm_head; old ones store RoPE buffers.
    return (name == "lm_head.weight" and config.tie_word_embeddings) or name.endswith("rotary_emb.inv_freq")


def load_hf_dir(path: Path, model_id: str, *, progress: bool) -> LoadedModel:
    config, declared = _read_config(path)
    try:
        tokenizer = Tokenizer.from_hf_dir(path)
    except TokenizerError as exc:
        raise ModelLoadError(str(exc)) from exc
    try:
        # The engine stops on the tokenizer's full stop-token list; keep the config in step.
        config = dataclasses.replace(
            config,
            eos_token_ids=tokenizer.eos_token_ids,
            bos_token_id=config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id,
        )
    except ModelConfigError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    expected = config.weight_shapes()
    weights: dict[str, torch.Tensor] = {}
    files = weight_files(path)
    for file in track(files, total=len(files), description=f"Loading {model_id}", enabled=progress):
        try:
            # mmap: float32 tensors stay backed by the page cache (shared between processes).
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if _ignored(name, config):
                        continue
                    if name not in expected:
                        raise ModelLoadError(f"{file.name}: tensor {name!r} is not part of a plain Llama model")
                    tensor = f.get_tensor(name)
                    if tensor.dtype not in _FLOAT_DTYPES:
                        raise ModelLoadError(f"{file.name}: tensor {name!r} has dtype {tensor.dtype}; "
                                             "only float32, float16 and bfloat16 are supported")
                    if tuple(tensor.shape) != expected[name]:
                        raise ModelLoadError(f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                             f"expected {expected[name]}")
                    weights[name] = tensor  # as stored: the model converts to engine.dtype on its device
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    missing = sorted(expected.keys() - weights.keys())
    if missing:
        raise ModelLoadError(f"{path} lacks tensors: {', '.join(missing[:5])}")
    logger.info("loaded %s from %s (%d tensors in %d files)", model_id, path, len(weights), len(files))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, model_id=model_id, torch_dtype=declared)
