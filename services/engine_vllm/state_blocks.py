"""Recurrent-state snapshots of a hybrid model as Crescent blocks (hybrid_layout.py says when
vLLM keeps one). vLLM keeps each state layer's state for one block as one page of raw bytes (on
its CPU build an int8 tensor ``[blocks, 1, 1, page_bytes]``; elsewhere possibly a list of
tensors, conv state then SSM state); a snapshot is those bytes of every state layer, in layer
order, as one ``uint8`` block. Its key (``state_key``) names the state format, so bytes of
another layout are never found; its tokens are the block's, compared on load like a block's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

StateLayer = torch.Tensor | Sequence[torch.Tensor]


def _parts(layer: StateLayer, block_id: int) -> list[torch.Tensor]:
    """Views (never copies: writes must land in vLLM's cache) of one block of a state layer."""
    tensors = [layer] if isinstance(layer, torch.Tensor) else list(layer)
    rows = [t[block_id] for t in tensors]
    if not all(row.is_contiguous() for row in rows):
        raise ValueError("a state layer whose block is not contiguous: Crescent cannot snapshot it as bytes")
    return [row.view(-1).view(torch.uint8) for row in rows]


def state_bytes(layers: Sequence[StateLayer]) -> int:
    """Bytes of one snapshot: one block of every state layer."""
    return sum(part.numel() for layer in layers for part in _parts(layer, 0))


def read_state(layers: Sequence[StateLayer], block_ids: Sequence[int], out: torch.Tensor) -> None:
    """Copy each state layer's block (``block_ids[i]`` for layer ``i``) into the flat ``uint8`` ``out``."""
    at = 0
    for layer, block_id in zip(layers, block_ids, strict=True):
        for part in _parts(layer, block_id):
            out[at:at + part.numel()].copy_(part)
            at += part.numel()
    assert at == out.numel(), "a snapshot is exactly one block of every state layer"


def write_state(layers: Sequence[StateLayer], block_ids: Sequence[int], src: torch.Tensor) -> None:
    """Copy a snapshot (flat ``uint8``) back into each state layer's block."""
    at = 0
    for layer, block_id in zip(layers, block_ids, strict=True):
        for part in _parts(layer, block_id):
            part.copy_(src[at:at + part.numel()])
            at += part.numel()
    assert at == src.numel(), "a snapshot is exactly one block of every state layer"
