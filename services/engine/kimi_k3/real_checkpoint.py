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
``EngineSettings.mxfp4_experts``); every other MXFP4 weight is dequantised to fp32 here. Float
tensors become fp32, or with ``keep_stored`` (a 16-bit compute dtype: ``load_k3_model``) stay in
the dtype they are stored in, so a bf16 checkpoint is never held in fp32 on the host on its way to
a bf16 model (the model's cast gives the same bits from either).

Loading is one pass over memory-mapped shards, tensor by tensor (``read_weights``): each tensor is
converted and placed where the model keeps it — experts into their stacked buffers — before the
next is read, so the checkpoint is never held twice in host memory.
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
from crescent.services.engine.loader.safetensors_header import read_header

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


def read_weights(path: Path, cfg: K3Config, fmt: RealFormat, *,
                 keep_packed: bool = False, keep_stored: bool = False) -> dict[str, torch.Tensor | Mxfp4Tensor]:
    """Every text-model tensor of the checkpoint under Crescent's names (``to_crescent_names``'s
    mapping), fp32 (``keep_stored``: float tensors in their stored dtype) or, for MXFP4 routed
    experts with ``keep_packed``, ``Mxfp4Tensor``.

    One pass, tensor by tensor: each shard is memory-mapped (``safe_open``), each tensor read,
    converted and put where the model keeps it before the next is read — routed experts and the
    shared experts' gate/up straight into their stacked buffers — so the weights are never held
    twice: the peak is the loaded weights plus one tensor in flight and the mapped shard's pages
    (``loadtest/bench_load_memory.py`` measures it). compressed-tensors MXFP4 pairs
    (``weight_packed`` + ``weight_scale``) become ``NAME.weight`` once both halves were read."""
    into = _Assembly(cfg, fmt, keep_packed, keep_stored)
    files = weight_files(path)
    stored_in = {name: file for file in files for name in read_header(file)}  # headers only
    order = {file: k for k, file in enumerate(files)}
    skipped: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if not name.startswith(fmt.prefix):
                        if fmt.prefix and name.startswith(_VISION_PREFIXES):
                            skipped.append(name)
                            continue
                        raise ModelLoadError(f"{file.name}: tensor {name!r} is not part of a {fmt.model_type} checkpoint")
                    local = name[len(fmt.prefix):]
                    if local.endswith((".weight_packed", ".weight_scale")):
                        base = local.rpartition("_")[0]
                        packed, scale = fmt.prefix + base + "_packed", fmt.prefix + base + "_scale"
                        other = scale if name == packed else packed
                        if other not in stored_in:
                            raise ModelLoadError(f"MXFP4 tensor {packed!r} has no {other.rpartition('.')[2]} beside it")
                        if order[stored_in[other]] > order[file]:
                            continue  # read both halves when the later one's shard is open
                        halves = {name: f.get_tensor(name), other: _read_one(stored_in[other], other, f, file)}
                        mx = _packed_mxfp4(packed, halves[packed], halves[scale])
                        del halves
                        routed = "block_sparse_moe.experts." in base
                        into.put(base, mx if keep_packed and routed else mx.dequantize())
                        continue
                    tensor = f.get_tensor(name)
                    if tensor.dtype not in _FLOATS:
                        raise ModelLoadError(f"tensor {name!r} has dtype {tensor.dtype}")
                    into.put(local, tensor)
                    del tensor  # before the next read: one tensor in flight
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    if skipped:
        log.info("skipping %d vision-tower/projector tensors (e.g. %s): text-only serving", len(skipped), skipped[0])
    return into.finish()


def _read_one(file: Path, name: str, open_file, open_path: Path) -> torch.Tensor:
    """One tensor of ``file``: from the shard already open, or from another opened just for it
    (an MXFP4 weight whose halves sit in two shards) and closed again at once."""
    if file == open_path:
        return open_file.get_tensor(name)
    with safe_open(str(file), framework="pt", device="cpu") as other:
        return other.get_tensor(name).clone()  # a copy: the shard's mapping closes here


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


class _Assembly:
    """Puts real tensors where Crescent's model keeps them, one at a time (renamed, reshaped, fp32);
    per-expert ``w1``/``w3``/``w2`` land in ``experts.gate_up_proj [E, 2F, L]`` (w1 rows, then
    w3) and ``experts.down_proj [E, L, F]``, shared-expert gate/up/down in
    ``shared_experts.gate_up_proj [1, 2Fs, D]`` and ``down_proj [1, D, Fs]``, each allocated once."""

    def __init__(self, cfg: K3Config, fmt: RealFormat, keep_packed: bool, keep_stored: bool = False) -> None:
        self.cfg, self.fmt, self.keep_packed, self.keep_stored = cfg, fmt, keep_packed, keep_stored
        self.out: dict[str, torch.Tensor | Mxfp4Tensor] = {}
        self.filled: dict[tuple[int, str], set[int]] = {}  # (layer, w1/w2/w3) -> experts placed

    def put(self, name: str, t: torch.Tensor | Mxfp4Tensor) -> None:
        if name in _TOP_RENAMES:
            self.out[_TOP_RENAMES[name]] = self._own(t.reshape(-1) if name.endswith("proj.weight") else t)
            return
        m = _LAYER.match(name)
        if m is None:
            self.out[name] = self._own(t)
            return
        i, local = int(m.group(1)), m.group(2)
        if i >= self.cfg.num_layers:
            if i < self.cfg.num_layers + self.fmt.nextn_layers:
                return  # a multi-token-prediction layer: for speculative decoding, not served here
            raise ModelLoadError(f"tensor {self.fmt.prefix + name!r}: layer {i} is past num_hidden_layers "
                                 f"({self.cfg.num_layers})")
        p = f"model.layers.{i}."
        if e := _EXPERT.match(local):
            self._expert(i, int(e.group(1)), e.group(2), t)
        elif s := _SHARED.match(local):
            self._shared(i, s.group(1), t)
        elif local in _RENAMES:
            self.out[p + _RENAMES[local]] = self._own(t.reshape(-1) if local.endswith("res_proj.weight") else t)
        elif local.endswith("_conv1d.weight"):
            self.out[p + local] = self._own(t.reshape(t.shape[0], -1))  # [C, 1, W] -> [C, W]
        elif local == "self_attn.A_log":
            self.out[p + local] = _a_log(self.cfg, self.fmt.prefix + name, _fp32(t))
        elif local == "self_attn.dt_bias":
            self.out[p + local] = self._own(t.reshape(-1))
        else:
            self.out[p + local] = self._own(t)

    def _expert(self, i: int, e: int, w: str, t: torch.Tensor | Mxfp4Tensor) -> None:
        cfg = self.cfg
        where = f"{self.fmt.prefix}model.layers.{i}.block_sparse_moe.experts"
        if e >= cfg.num_experts:
            raise ModelLoadError(f"{where}: expert {e} {w} is past num_experts")
        f, lat = cfg.moe_intermediate_size, cfg.expert_input_size
        name = f"model.layers.{i}.mlp.experts." + ("down_proj" if w == "w2" else "gate_up_proj")
        rows = slice(0, f) if w == "w1" else slice(f, 2 * f) if w == "w3" else slice(0, lat)
        expected = (lat, f) if w == "w2" else (f, lat)
        if tuple(t.shape) != expected:
            raise ModelLoadError(f"tensor {where}.{e}.{w}.weight has shape {tuple(t.shape)}, expected {expected}")
        full = (cfg.num_experts, lat if w == "w2" else 2 * f, expected[1])
        buf = self.out.get(name)
        if buf is None:
            buf = self.out[name] = _empty(t, full, self._dtype(t))
        if isinstance(buf, Mxfp4Tensor) != isinstance(t, Mxfp4Tensor):
            raise ModelLoadError(f"{where}: experts of one layer must all be MXFP4 or all be float ({e} {w} is not)")
        if not isinstance(t, Mxfp4Tensor) and (wider := torch.promote_types(buf.dtype, t.dtype)) != buf.dtype:
            buf = self.out[name] = buf.to(wider)  # experts stored in two dtypes: both exact in the wider
        if isinstance(t, Mxfp4Tensor):
            buf.blocks[e, rows].copy_(t.blocks)
            buf.scales[e, rows].copy_(t.scales)
        else:
            buf[e, rows].copy_(t)  # converts to the buffer's dtype in place: no second copy of the expert
        self.filled.setdefault((i, w), set()).add(e)

    def _shared(self, i: int, part: str, t: torch.Tensor | Mxfp4Tensor) -> None:
        cfg, t = self.cfg, self._own(t)
        fs, d = cfg.shared_intermediate_size, cfg.hidden_size
        p = f"model.layers.{i}.mlp.shared_experts."
        self.filled.setdefault((i, "shared_" + part), set()).add(0)
        if part == "down":
            self.out[p + "down_proj"] = t[None]
            return
        if tuple(t.shape) != (fs, d):
            raise ModelLoadError(f"tensor {self.fmt.prefix}model.layers.{i}.block_sparse_moe.shared_experts."
                                 f"{part}_proj.weight has shape {tuple(t.shape)}, expected {(fs, d)}")
        buf = self.out.setdefault(p + "gate_up_proj", torch.empty((1, 2 * fs, d), dtype=t.dtype))
        if (wider := torch.promote_types(buf.dtype, t.dtype)) != buf.dtype:  # gate and up in two dtypes
            buf = self.out[p + "gate_up_proj"] = buf.to(wider)
        rows = slice(0, fs) if part == "gate" else slice(fs, 2 * fs)
        buf[0, rows].copy_(t)

    def _dtype(self, t: torch.Tensor | Mxfp4Tensor) -> torch.dtype:
        """Where a float tensor is kept: fp32, or its stored dtype with ``keep_stored``."""
        return t.dtype if self.keep_stored and not isinstance(t, Mxfp4Tensor) else torch.float32

    def _own(self, t: torch.Tensor | Mxfp4Tensor) -> torch.Tensor:
        """In memory of its own (see ``_fp32``), in ``_dtype(t)``."""
        return t.dequantize() if isinstance(t, Mxfp4Tensor) else t.to(self._dtype(t), copy=True)

    def finish(self) -> dict[str, torch.Tensor | Mxfp4Tensor]:
        """The weights, once every expert of every MoE layer and every shared-expert part arrived."""
        layers = sorted({i for i, w in self.filled})
        for i in layers:
            if any(w.startswith("shared_") for j, w in self.filled if j == i):
                for part in ("gate", "up", "down"):
                    if (i, "shared_" + part) not in self.filled:
                        raise ModelLoadError(f"{self.fmt.prefix}model.layers.{i}.block_sparse_moe.shared_experts "
                                             f"lacks {part}_proj.weight")
            if not any(w in ("w1", "w2", "w3") for j, w in self.filled if j == i):
                continue
            for w in ("w1", "w3", "w2"):
                missing = sorted(set(range(self.cfg.num_experts)) - self.filled.get((i, w), set()))
                if missing:
                    raise ModelLoadError(f"{self.fmt.prefix}model.layers.{i}.block_sparse_moe.experts: expert "
                                         f"{missing[0]} {w} is missing")
        return self.out


def _fp32(t: torch.Tensor | Mxfp4Tensor) -> torch.Tensor:
    """fp32 in memory of its own: a tensor ``safe_open`` hands out may be a view of the mapped
    shard, and one kept would keep the shard's pages mapped (and resident) after loading."""
    return t.dequantize() if isinstance(t, Mxfp4Tensor) else t.to(torch.float32, copy=True)


def _empty(like: torch.Tensor | Mxfp4Tensor, shape: tuple[int, int, int],
           dtype: torch.dtype = torch.float32) -> torch.Tensor | Mxfp4Tensor:
    if isinstance(like, Mxfp4Tensor):
        e, n, k = shape
        return Mxfp4Tensor(torch.empty((e, n, k // 32, 16), dtype=torch.uint8), torch.empty((e, n, k // 32), dtype=torch.uint8))
    return torch.empty(shape, dtype=dtype)


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
