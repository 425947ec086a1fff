"""Read a real Moonshot checkpoint (``kimi_linear`` or ``kimi_k3``) into Crescent's tensor names.

The real names and shapes (Moonshot's ``modeling_kimi*.py``; docs/k3.md has the whole map):

- K3 prefixes the text model with ``language_model.``; its vision tower and projector
  (``vision_tower.*``, ``mm_projector.*``) are skipped with one log line (text-only serving).
- KDA: short convs ``{q,k,v}_conv1d.weight`` ``[C, 1, W]``; ``A_log`` ``[1, 1, H, 1]``
  (Kimi-Linear) or ``[H]``, possibly zero-padded (K3 stores 96 heads in a 128-entry buffer);
  the output gate is one ``g_proj`` (K3) or ``g_a_proj``/``g_b_proj`` (Kimi-Linear).
- AttnRes: ``self_attention_res_proj.weight`` ``[1, D]`` / ``self_attention_res_norm.weight``,
  ``mlp_res_proj``/``mlp_res_norm``, and ``model.output_attn_res_proj``/``_norm``.
- MoE: ``block_sparse_moe.gate.{weight,e_score_correction_bias}``, routed experts
  ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate/up/down), each either ``.weight`` or, in the
  compressed-tensors MXFP4 layout, ``.weight_packed`` (uint8 ``[out, in/2]``, low nibble first)
  + ``.weight_scale`` (uint8 E8M0 ``[out, in/32]``); ``routed_expert_down_proj``,
  ``routed_expert_norm``, ``routed_expert_up_proj`` (the latent); ``shared_experts.{gate,up,down}_proj``
  (one MLP for all shared experts). Dense layers: ``mlp.{gate,up,down}_proj``.

MXFP4 routed experts can stay packed (``Mxfp4Tensor``, ``keep_packed``: the engine's default,
``EngineSettings.mxfp4_experts``); every other MXFP4 weight is dequantised to fp32 here.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from crescent.kernels.mxfp4.packed import Mxfp4Tensor
from crescent.services.engine.kimi_k3.config import K3Config
from crescent.services.engine.kimi_k3.hf_formats import RealFormat
from crescent.services.engine.loader.errors import ModelLoadError
from crescent.services.engine.loader.hf_loader import weight_files

log = logging.getLogger(__name__)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_VISION_PREFIXES = ("vision_tower.", "mm_projector.", "vision.", "multi_modal_projector.")
_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
# layer-local real name -> Crescent's name (identical names are not listed)
_RENAMES = {
    "self_attention_res_proj.weight": "attn_res.query",
    "self_attention_res_norm.weight": "attn_res.norm.weight",
    "mlp_res_proj.weight": "mlp_res.query",
    "mlp_res_norm.weight": "mlp_res.norm.weight",
    "block_sparse_moe.gate.weight": "mlp.gate.weight",
    "block_sparse_moe.gate.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
    "block_sparse_moe.routed_expert_down_proj.weight": "mlp.latent_down.weight",
    "block_sparse_moe.routed_expert_up_proj.weight": "mlp.latent_up.weight",
    "block_sparse_moe.routed_expert_norm.weight": "mlp.latent_norm.weight",
}
_TOP_RENAMES = {
    "model.output_attn_res_proj.weight": "model.final_res.query",
    "model.output_attn_res_norm.weight": "model.final_res.norm.weight",
}
_SHARED = re.compile(r"block_sparse_moe\.shared_experts\.(gate|up|down)_proj\.weight$")


def read_tensors(path: Path, fmt: RealFormat, *, keep_packed: bool = False) -> dict[str, torch.Tensor | Mxfp4Tensor]:
    """Every text-model tensor of the checkpoint, fp32, by its real name without the prefix;
    compressed-tensors MXFP4 pairs become ``NAME.weight``: dequantised, or for routed experts with
    ``keep_packed`` an ``Mxfp4Tensor``."""
    raw: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if not name.startswith(fmt.prefix):
                        if fmt.prefix and name.startswith(_VISION_PREFIXES):
                            skipped.append(name)
                            continue
                        raise ModelLoadError(f"{file.name}: tensor {name!r} is not part of a {fmt.model_type} checkpoint")
                    raw[name[len(fmt.prefix):]] = f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    if skipped:
        log.info("skipping %d vision-tower/projector tensors (e.g. %s): text-only serving", len(skipped), skipped[0])
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(".weight_scale"):
            if name.removesuffix("_scale") + "_packed" not in raw:
                raise ModelLoadError(f"MXFP4 tensor {fmt.prefix + name!r} has no weight_packed beside it")
            continue
        if name.endswith(".weight_packed"):
            mx = _packed_mxfp4(fmt.prefix + name, t, raw.get(name.removesuffix("_packed") + "_scale"))
            routed = "block_sparse_moe.experts." in name
            out[name.removesuffix("_packed")] = mx if keep_packed and routed else mx.dequantize()
        elif t.dtype in _FLOATS:
            out[name] = t.float()
        else:
            raise ModelLoadError(f"tensor {fmt.prefix + name!r} has dtype {t.dtype}")
    return out


def _packed_mxfp4(name: str, packed: torch.Tensor, scale: torch.Tensor | None) -> Mxfp4Tensor:
    """compressed-tensors MXFP4: ``weight_packed`` uint8 ``[out, in/2]`` + ``weight_scale`` uint8 ``[out, in/32]``."""
    if scale is None:
        raise ModelLoadError(f"MXFP4 tensor {name!r} has no weight_scale beside it")
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):  # E8M0 stored as its own dtype: same bytes
        scale = scale.view(torch.uint8)
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ModelLoadError(f"MXFP4 tensor {name!r}: weight_packed and weight_scale must be uint8, "
                             f"got {packed.dtype} and {scale.dtype}")
    rows, half = packed.shape
    if half % 16 or tuple(scale.shape) != (rows, half // 16):
        raise ModelLoadError(f"MXFP4 tensor {name!r}: weight_packed {tuple(packed.shape)} and weight_scale "
                             f"{tuple(scale.shape)} do not describe blocks of 32")
    return Mxfp4Tensor(packed.reshape(rows, half // 16, 16), scale)


def to_crescent_names(cfg: K3Config, fmt: RealFormat, real: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename (and reshape) real tensors into ``weights.weight_shapes(cfg)``'s names."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    shared: dict[tuple[int, str], torch.Tensor] = {}
    for name, t in real.items():
        if name in _TOP_RENAMES:
            out[_TOP_RENAMES[name]] = t.reshape(-1) if name.endswith("proj.weight") else t
            continue
        m = _LAYER.match(name)
        if m is None:
            out[name] = t
            continue
        i, local = int(m.group(1)), m.group(2)
        if i >= cfg.num_layers:
            if i < cfg.num_layers + fmt.nextn_layers:
                continue  # a multi-token-prediction layer: for speculative decoding, not served here
            raise ModelLoadError(f"tensor {fmt.prefix + name!r}: layer {i} is past num_hidden_layers ({cfg.num_layers})")
        p = f"model.layers.{i}."
        if e := _EXPERT.match(local):
            experts.setdefault((i, e.group(2)), {})[int(e.group(1))] = t
        elif s := _SHARED.match(local):
            shared[(i, s.group(1))] = t
        elif local in _RENAMES:
            out[p + _RENAMES[local]] = t.reshape(-1) if local.endswith("res_proj.weight") else t
        elif local.endswith("_conv1d.weight"):
            out[p + local] = t.reshape(t.shape[0], -1)  # [C, 1, W] -> [C, W]
        elif local == "self_attn.A_log":
            out[p + local] = _a_log(cfg, fmt.prefix + name, t)
        elif local == "self_attn.dt_bias":
            out[p + local] = t.reshape(-1)
        else:
            out[p + local] = t
    _assemble_experts(cfg, fmt, experts, out)
    _assemble_shared(fmt, shared, out)
    return out


def real_name(fmt: RealFormat, name: str) -> str:
    """The checkpoint name(s) a Crescent tensor name comes from, for error messages."""
    top = {v: k for k, v in _TOP_RENAMES.items()}
    if name in top:
        return fmt.prefix + top[name]
    m = _LAYER.match(name)
    if m is None:
        return fmt.prefix + name
    p, local = f"{fmt.prefix}model.layers.{m.group(1)}.", m.group(2)
    local = {v: k for k, v in _RENAMES.items()}.get(local, local)
    local = {"mlp.experts.gate_up_proj": "block_sparse_moe.experts.{e}.w1/w3.weight",
             "mlp.experts.down_proj": "block_sparse_moe.experts.{e}.w2.weight",
             "mlp.shared_experts.gate_up_proj": "block_sparse_moe.shared_experts.gate_proj/up_proj.weight",
             "mlp.shared_experts.down_proj": "block_sparse_moe.shared_experts.down_proj.weight"}.get(local, local)
    return p + local


def _a_log(cfg: K3Config, name: str, t: torch.Tensor) -> torch.Tensor:
    """``[H]`` per-head log decay rates from ``[1, 1, H, 1]``, ``[H]`` or a zero-padded buffer."""
    flat, h = t.reshape(-1), cfg.kda_num_v_heads
    if flat.numel() < h or (flat.numel() > h and (t.dim() != 1 or bool(flat[h:].any()))):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}: expected {h} heads "
                             f"([{h}], [1, 1, {h}, 1], or a 1-D buffer whose entries past {h} are zero)")
    return flat[:h].clone()


def _assemble_experts(cfg: K3Config, fmt: RealFormat, experts: dict, out: dict[str, torch.Tensor]) -> None:
    """Per-expert ``w1``/``w3``/``w2`` -> ``experts.gate_up_proj [E, 2F, L]`` and ``down_proj [E, L, F]``."""
    layers = sorted({i for i, _ in experts})
    for i in layers:
        parts = {}
        for w in ("w1", "w3", "w2"):
            found = experts.get((i, w), {})
            missing = [e for e in range(cfg.num_experts) if e not in found]
            if missing or len(found) != cfg.num_experts:
                raise ModelLoadError(f"{fmt.prefix}model.layers.{i}.block_sparse_moe.experts: expert {missing[0] if missing else max(found)}"
                                     f" {w} is {'missing' if missing else 'past num_experts'}")
            ordered = [found[e] for e in range(cfg.num_experts)]
            parts[w] = Mxfp4Tensor.stack(ordered) if isinstance(ordered[0], Mxfp4Tensor) else torch.stack(ordered)
        p = f"model.layers.{i}.mlp.experts."
        gate_up = [parts["w1"], parts["w3"]]
        out[p + "gate_up_proj"] = (Mxfp4Tensor.cat_rows(gate_up) if isinstance(gate_up[0], Mxfp4Tensor)
                                   else torch.cat(gate_up, dim=1))
        out[p + "down_proj"] = parts["w2"]


def _assemble_shared(fmt: RealFormat, shared: dict, out: dict[str, torch.Tensor]) -> None:
    """The shared-expert MLP -> ``shared_experts.gate_up_proj [1, 2Fs, D]`` and ``down_proj [1, D, Fs]``."""
    for i in sorted({i for i, _ in shared}):
        got = {k: shared.get((i, k)) for k in ("gate", "up", "down")}
        if any(v is None for v in got.values()):
            lacking = next(k for k, v in got.items() if v is None)
            raise ModelLoadError(f"{fmt.prefix}model.layers.{i}.block_sparse_moe.shared_experts lacks {lacking}_proj.weight")
        p = f"model.layers.{i}.mlp.shared_experts."
        out[p + "gate_up_proj"] = torch.cat([got["gate"], got["up"]])[None]
        out[p + "down_proj"] = got["down"][None]
