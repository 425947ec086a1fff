"""vLLM's paged KV ↔ Crescent's block payload.

vLLM hands connectors each attention layer's cache as a standardized view ``[blocks, heads,
block_size, C]`` (``kv_cache_layout`` 'LBHNC' on its CPU build): for standard attention ``C`` is
a key row then a value row (``2 x head_dim``); for MLA ``heads`` is 1 and ``C`` the latent.
Crescent's native engine stores a block as ``[layers, 2, tokens, kv_heads, head_dim]``
(``paged-v1``), so a vLLM instance writes exactly that layout for standard attention: blocks of
one model are the same bytes whichever backend computed them, and a mixed fleet shares them.
MLA layers are stored ``[layers, tokens, latent]`` under their own format name (``mla-v1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LayerGeometry:
    num_layers: int
    heads: int          # KV heads (1 for MLA)
    block_size: int
    width: int          # C: 2 x head_dim, or the MLA latent
    mla: bool
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One Crescent block's payload shape."""
        if self.mla:
            return (self.num_layers, self.block_size, self.width)
        return (self.num_layers, 2, self.block_size, self.heads, self.width // 2)

    @property
    def kv_format(self) -> str:
        """The format an instance registers (the scheduler refuses instances of one model that disagree)."""
        return ("mla-v1:" if self.mla else "paged-v1:") + "x".join(str(d) for d in self.block_shape)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def geometry(layers: list[torch.Tensor], mla: bool) -> LayerGeometry:
    """The geometry of vLLM's per-layer views; every layer must agree."""
    if not layers:
        raise ValueError("vLLM registered no KV cache layers")
    first = layers[0]
    if first.dim() != 4:
        raise ValueError(f"expected vLLM's [blocks, heads, block_size, C] layer view, got shape {tuple(first.shape)}")
    for layer in layers[1:]:
        if layer.shape[1:] != first.shape[1:] or layer.dtype != first.dtype:
            raise ValueError("vLLM's KV layers differ in shape or dtype; Crescent blocks need one geometry")
    _, heads, block_size, width = first.shape
    if not mla and width % 2:
        raise ValueError(f"a standard attention layer's row holds a key and a value; width {width} is odd")
    return LayerGeometry(len(layers), heads, block_size, width, mla, first.dtype)


def layer_rows(geo: LayerGeometry, layer_view: torch.Tensor, block_id: int) -> torch.Tensor:
    """One layer of one block, in the payload's per-layer layout (a copy-free view where possible):
    ``[2, tokens, heads, head_dim]`` or, MLA, ``[tokens, latent]``."""
    rows = layer_view[block_id]  # [heads, tokens, C]
    if geo.mla:
        return rows[0]
    return rows.unflatten(-1, (2, geo.width // 2)).permute(2, 1, 0, 3)


def write_block(geo: LayerGeometry, layer_views: list[torch.Tensor], block_id: int, payload: torch.Tensor) -> None:
    """Copy one Crescent block payload (``geo.block_shape``) into vLLM block ``block_id`` of every layer."""
    for layer, view in enumerate(layer_views):
        layer_rows(geo, view, block_id).copy_(payload[layer])
