"""Build a K3Model from a ``ModelSource``: a seeded preset, or a Hugging Face-style directory.

A directory holds ``config.json`` and safetensors shards (listed by
``model.safetensors.index.json`` when present), in one of three formats:

- a real Moonshot checkpoint, ``model_type: "kimi_linear"`` (Kimi-Linear) or ``"kimi_k3"`` with a
  ``text_config`` (Kimi K3): ``hf_formats.py`` reads the config, ``real_checkpoint.py`` the
  tensors under their real names (compressed-tensors MXFP4 experts included);
- Crescent's own flat format (``model_type: "kimi_k3"``, no ``text_config``): tensors named as
  ``weights.weight_shapes``, each in float32/bfloat16/float16 or in MXFP4 as ``NAME_blocks``
  (uint8 ``[..., K/32, 16]``) and ``NAME_scales`` (uint8 ``[..., K/32]``), possibly in
  different shards.

MXFP4 routed experts of Crescent's format stay packed in memory (``Mxfp4Tensor``, 4.25 bits per
weight) and run through the MXFP4 matmul (``K3Ops.expert_linear``), unless
``mxfp4_experts="dequantize"``; every other MXFP4 tensor is dequantised to fp32 at load.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from crescent.kernels.mxfp4.packed import Mxfp4Tensor
from crescent.kernels.mxfp4.reference import dequantize_mxfp4, quantize_mxfp4
from crescent.kernels.moe.reference import quantile_balance_offsets
from crescent.services.engine.kimi_k3.config import FP8_CACHE, NANO, K3Config
from crescent.services.engine.kimi_k3.hf_formats import RealFormat, is_real_kimi_config, parse_real_config
from crescent.services.engine.kimi_k3.model import K3Model
from crescent.services.engine.kimi_k3.real_checkpoint import read_weights, real_name
from crescent.services.engine.kimi_k3.snapshots import SnapshotPolicy
from crescent.services.engine.kimi_k3.weights import random_weights, weight_shapes
from crescent.services.engine.loader.errors import ModelLoadError
from crescent.services.engine.loader.hf_loader import weight_files
from crescent.services.engine.loader.safetensors_header import stored_float_dtype
from crescent.services.model.hf_config import config_dtype
from crescent.services.model.model_source import ModelSource

log = logging.getLogger(__name__)

SEEDED_CONFIGS: dict[str, K3Config] = {"kimi-k3-nano": NANO}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_ROUTED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")  # what may stay packed in MXFP4


def load_k3_model(source: ModelSource, *, device: torch.device | str = "cpu", dtype: str = "auto",
                  mxfp4_experts: str = "packed", snapshots: SnapshotPolicy = SnapshotPolicy(),
                  cache_dtype: str | None = None) -> K3Model:
    """``device``, ``dtype``: ``EngineSettings.device`` and ``.dtype`` ("auto": ``model_dtype``).
    ``mxfp4_experts``: "packed" keeps MXFP4 routed experts packed (``Mxfp4Tensor``), "dequantize"
    expands them at load (``EngineSettings.mxfp4_experts``). ``snapshots``: the prefix
    cache's KDA state snapshot policy (``EngineSettings.state_snapshot_*``). ``cache_dtype``:
    overrides the config's ``cache_dtype`` (``EngineSettings.kv_cache_dtype``, "fp8" for e4m3
    latents; None keeps it)."""
    if source.random_seed is not None:
        cfg = SEEDED_CONFIGS[source.model_id]
        compute = model_dtype(cfg, dtype, device)  # from the checkpoint's dtype, before a cache override
        cfg = _with_cache_dtype(cfg, cache_dtype)
        return K3Model(cfg, seeded_weights(cfg, source.random_seed), device=device, dtype=compute, snapshots=snapshots)
    cfg, real = read_any_config(source.path)
    compute = model_dtype(cfg, dtype, device)
    cfg = _with_cache_dtype(cfg, cache_dtype)
    # A 16-bit model: float tensors stay as stored (K3Model's cast gives the same bits from them as
    # from an fp32 copy, which would double a bf16 checkpoint's host memory on the way).
    keep_stored = compute != torch.float32
    weights = (load_real_weights(source.path, cfg, real, mxfp4_experts=mxfp4_experts, keep_stored=keep_stored)
               if real else load_weights(source.path, cfg, mxfp4_experts=mxfp4_experts, keep_stored=keep_stored))
    return K3Model(cfg, weights, device=device, dtype=compute, snapshots=snapshots)


def model_dtype(cfg: K3Config, dtype: str, device: torch.device | str) -> torch.dtype:
    """The compute dtype: as named, or for "auto" the checkpoint's 16-bit dtype on a GPU and fp32
    on the CPU (bf16 matmuls are ~4.5x slower than fp32 on a CPU without AVX-512 bf16)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if torch.device(device).type == "cpu" or cfg.cache_dtype not in ("bfloat16", "float16"):
        return torch.float32
    return getattr(torch, cfg.cache_dtype)


def _with_cache_dtype(cfg: K3Config, cache_dtype: str | None) -> K3Config:
    if cache_dtype == "fp8":  # vLLM's name: e4m3 (fp8_e4m3), latents only (memory.tail_torch_dtype)
        cache_dtype = FP8_CACHE
    return cfg if cache_dtype is None else dataclasses.replace(cfg, cache_dtype=cache_dtype)


def seeded_weights(cfg: K3Config, seed: int) -> dict[str, torch.Tensor]:
    """``random_weights`` with router offsets quantile-balanced on a seeded calibration sample."""
    weights = random_weights(cfg, seed)
    balance_router_offsets(cfg, weights, torch.randn(4 * cfg.num_experts * 32, cfg.hidden_size,
                                                     generator=torch.Generator().manual_seed(seed + 1)))
    return weights


def balance_router_offsets(cfg: K3Config, weights: dict[str, torch.Tensor], calibration: torch.Tensor) -> None:
    """Set every MoE layer's ``e_score_correction_bias`` so that the calibration tokens spread
    evenly over the experts (``quantile_balance_offsets`` on their router scores)."""
    x = calibration * torch.rsqrt(calibration.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    for i in range(cfg.num_layers):
        if cfg.is_moe_layer(i):
            p = f"model.layers.{i}.mlp.gate."
            scores = torch.sigmoid(x @ weights[p + "weight"].t())
            weights[p + "e_score_correction_bias"] = quantile_balance_offsets(scores, cfg.num_experts_per_tok)


def read_config(path: Path) -> K3Config:
    return read_any_config(path)[0]


def read_any_config(path: Path) -> tuple[K3Config, RealFormat | None]:
    """The model config, and for a real Moonshot checkpoint how its tensors are stored."""
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError("config.json is not a JSON object")
        if is_real_kimi_config(raw):
            # no dtype in the config: the model's dtype is the one its weights are stored in
            # (a config.json alone, as `crescent plan` may read: float32, what Crescent computes in)
            shards = config_dtype(raw) is None and any(path.glob("*.safetensors"))
            weights_dtype = stored_float_dtype(weight_files(path)) if shards else None
            return parse_real_config(raw, weights_dtype)
        return K3Config.from_hf_dict(raw), None
    except (OSError, ValueError) as exc:  # ModelConfigError is a ValueError
        raise ModelLoadError(f"{path / 'config.json'}: {exc}") from exc


def load_real_weights(path: Path, cfg: K3Config, fmt: RealFormat, *, mxfp4_experts: str = "packed",
                      keep_stored: bool = False) -> dict[str, torch.Tensor | Mxfp4Tensor]:
    """A real checkpoint's tensors under Crescent's names, checked against ``weight_shapes``
    (``keep_stored``: see ``load_weights``)."""
    weights = read_weights(path, cfg, fmt, keep_packed=mxfp4_experts == "packed", keep_stored=keep_stored)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in weights:
        raise ModelLoadError(f"{path} lacks tensor {fmt.prefix + 'lm_head.weight'!r}")
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied: the embedding is the head
    _check_complete(path, weights, weight_shapes(cfg), lambda name: real_name(fmt, name))
    return weights


def _check_complete(path: Path, weights: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                    source_name: Callable[[str], str] = str) -> None:
    """Every tensor the config needs, in its shape, and none it does not use (named as stored)."""
    extra = sorted(weights.keys() - expected.keys())
    if extra:
        raise ModelLoadError(f"{path}: tensor {source_name(extra[0])!r} is not part of this model's config")
    for name, shape in expected.items():
        if name not in weights:
            raise ModelLoadError(f"{path} lacks tensor {source_name(name)!r}")
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(f"tensor {source_name(name)!r} has shape {tuple(weights[name].shape)} "
                                 f"(as Crescent holds it), expected {shape}")


def load_weights(path: Path, cfg: K3Config, *, mxfp4_experts: str = "packed",
                 keep_stored: bool = False) -> dict[str, torch.Tensor | Mxfp4Tensor]:
    """Crescent-format tensors; MXFP4 routed experts stay packed unless ``mxfp4_experts="dequantize"``.
    Float tensors in fp32, or with ``keep_stored`` (a 16-bit compute dtype) in their stored dtype;
    dequantized MXFP4 tensors in fp32 either way."""
    if mxfp4_experts not in ("packed", "dequantize"):
        raise ValueError(f"mxfp4_experts must be 'packed' or 'dequantize', got {mxfp4_experts!r}")
    expected = weight_shapes(cfg)
    weights: dict[str, torch.Tensor] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    base, _, part = name.rpartition("_")
                    if part in ("blocks", "scales") and base in expected:
                        packed.setdefault(base, {})[part] = f.get_tensor(name)
                        continue
                    if name not in expected:
                        raise ModelLoadError(f"{file.name}: tensor {name!r} is not part of this kimi_k3 model")
                    tensor = f.get_tensor(name)
                    if tensor.dtype not in _FLOATS:
                        raise ModelLoadError(f"{file.name}: tensor {name!r} has dtype {tensor.dtype}")
                    weights[name] = tensor.to(tensor.dtype if keep_stored else torch.float32, copy=keep_stored)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    for name, parts in packed.items():
        if set(parts) != {"blocks", "scales"}:
            raise ModelLoadError(f"MXFP4 tensor {name!r} lacks its {'scales' if 'blocks' in parts else 'blocks'}")
        if parts["blocks"].dtype != torch.uint8 or parts["scales"].dtype != torch.uint8:
            raise ModelLoadError(f"MXFP4 tensor {name!r}: blocks and scales must be uint8")
        if mxfp4_experts == "packed" and name.endswith(_ROUTED_EXPERTS):
            weights[name] = Mxfp4Tensor(parts["blocks"], parts["scales"])  # 4.25 bits/weight resident
        else:
            weights[name] = dequantize_mxfp4(parts["blocks"], parts["scales"])
    _check_complete(path, weights, expected)
    return weights


def save_hf_dir(path: Path, cfg: K3Config, weights: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.bfloat16,
                mxfp4: bool = False, shards: int = 2) -> None:
    """Write a checkpoint directory this module loads (tests, conversions). With ``mxfp4``, every
    2-D+ projection whose input width is a multiple of 32 is stored as ``_blocks``/``_scales``."""
    path.mkdir(parents=True, exist_ok=True)
    config = cfg.to_hf_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    tensors: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if mxfp4 and t.dim() >= 2 and t.shape[-1] % 32 == 0 and name != "model.embed_tokens.weight":
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(t)
        else:
            tensors[name] = t.to(dtype).contiguous()
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}), encoding="utf-8")
