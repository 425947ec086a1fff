"""vLLM's paged KV ↔ Crescent's block payload.

vLLM hands a connector each attention layer's cache tensor as its attention backend lays it out,
and that layout is the backend's own. On vLLM's CPU build with the ``vec`` kernels (x86 without
AMX or with fp32; ``kv_cache_layout`` 'LBHNC') a layer is ``[blocks, kv_heads, block_size,
2 x head_dim]`` in shape, but each (block, head) holds its keys **dim-major** (``[head_dim,
block_size]``) and then its values token-major (``[block_size, head_dim]``): the kernels' order,
not one row per token. Measured against the native engine's KV for the same prompt (keys equal
within 1e-5, tests/engine_vllm).

- ``cpu-vec`` is converted to Crescent's native layout, ``[layers, 2, tokens, kv_heads,
  head_dim]`` (``paged-v1``): a block is the same bytes whichever backend computed it, and native
  and vLLM instances of one model share blocks.
- Every other layout (GPU backends, AMX, MLA) is stored as vLLM holds it, each layer's block rows
  as they are (``vllm-<layout>``): shared between vLLM instances of the same model and backend,
  never read by a native instance (another shape, so a miss), never converted on a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NATIVE_LAYOUTS = frozenset({"cpu-vec"})  # converted to the native engine's layout (checked in tests)


@dataclass(frozen=True, slots=True)
class LayerGeometry:
    layout: str                   # vLLM's attention layout ("cpu-vec", "cpu-amx", "cuda", "mla", ...)
    num_layers: int
    block_dim: int                # the dimension of a layer tensor that indexes blocks
    rows_shape: tuple[int, ...]   # one block of one layer as vLLM holds it
    dtype: torch.dtype

    @property
    def native(self) -> bool:
        return self.layout in NATIVE_LAYOUTS

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One Crescent block's payload shape."""
        if self.native:
            heads, block_size, width = self.rows_shape
            return (self.num_layers, 2, block_size, heads, width // 2)
        return (self.num_layers, *self.rows_shape)

    @property
    def kv_format(self) -> str:
        """The format an instance registers (the scheduler refuses instances of one model that disagree)."""
        name = "paged-v1" if self.native else f"vllm-{self.layout}"
        return f"{name}:" + "x".join(str(d) for d in self.block_shape)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def geometry(layers: list[torch.Tensor], layout: str, num_blocks: int) -> LayerGeometry:
    """The geometry of vLLM's per-layer tensors (every layer must agree)."""
    if not layers:
        raise ValueError("vLLM registered no KV cache layers")
    first = layers[0]
    for layer in layers[1:]:
        if layer.shape != first.shape or layer.dtype != first.dtype:
            raise ValueError("vLLM's KV layers differ in shape or dtype; Crescent blocks need one geometry")
    block_dim = next((d for d, size in enumerate(first.shape) if size == num_blocks), None)
    if block_dim is None:
        raise ValueError(f"no dimension of vLLM's KV layer {tuple(first.shape)} has its {num_blocks} blocks")
    rows = tuple(first.shape[:block_dim] + first.shape[block_dim + 1:])
    if layout in NATIVE_LAYOUTS and (block_dim != 0 or len(rows) != 3 or rows[2] % 2):
        raise ValueError(f"a {layout} layer should be [blocks, heads, block_size, 2 x head_dim], got {tuple(first.shape)}")
    return LayerGeometry(layout, len(layers), block_dim, rows, first.dtype)


def _native_views(geo: LayerGeometry, layer_view: torch.Tensor, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one block of one ``cpu-vec`` layer as ``[tokens, heads, head_dim]`` views."""
    heads, block_size, width = geo.rows_shape
    dim = width // 2
    flat = layer_view[block_id].reshape(heads, block_size * width)
    keys = flat[:, :block_size * dim].view(heads, dim, block_size).permute(2, 0, 1)
    values = flat[:, block_size * dim:].view(heads, block_size, dim).permute(1, 0, 2)
    return keys, values


def read_layer(geo: LayerGeometry, layer_view: torch.Tensor, block_id: int, out: torch.Tensor) -> None:
    """Copy one layer of vLLM block ``block_id`` into ``out`` (the payload's ``[layer]``)."""
    if geo.native:
        keys, values = _native_views(geo, layer_view, block_id)
        out[0].copy_(keys)
        out[1].copy_(values)
    else:
        out.copy_(layer_view.select(geo.block_dim, block_id))


def write_layer(geo: LayerGeometry, layer_view: torch.Tensor, block_id: int, src: torch.Tensor) -> None:
    """Copy one layer of a payload (``src``) into vLLM block ``block_id``."""
    if geo.native:
        keys, values = _native_views(geo, layer_view, block_id)
        keys.copy_(src[0])
        values.copy_(src[1])
    else:
        layer_view.select(geo.block_dim, block_id).copy_(src)


def write_block(geo: LayerGeometry, layer_views: list[torch.Tensor], block_id: int, payload: torch.Tensor) -> None:
    """Copy one Crescent block payload (``geo.block_shape``) into vLLM block ``block_id`` of every layer."""
    for layer, view in enumerate(layer_views):
        write_layer(geo, view, block_id, payload[layer])


def attention_layout(vllm_config) -> str:  # noqa: ANN001 - vllm.config.VllmConfig
    """The name of the layout vLLM's attention backend keeps this model's KV in."""
    if vllm_config.model_config.use_mla:
        return "mla"
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model, cache = vllm_config.model_config, vllm_config.cache_config
        return "cpu-" + _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
    return str(current_platform.device_name or "gpu").lower().replace(" ", "-")
