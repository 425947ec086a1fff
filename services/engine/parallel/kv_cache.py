"""The leader's KV cache of a tensor-parallel instance.

Every rank keeps its KV heads of every page (a ``PagedKvCache`` of ``kv_heads / size`` heads);
the leader alone keeps the ``PageManager``. Block payloads have the full, unsharded layout, so
the handoff, the kvstore and peers see bytes identical to a one-process instance's:
``read_block`` gathers the ranks' heads, ``write_block`` scatters them.

Its ``layer_layout`` is a one-process cache's (payloads are), so a decode leader takes
layer-wise handoffs: the slices are assembled into whole payloads, then written. It has no
``copy_layer``: copying one layer while the forward runs would need a collective from the
event loop's thread in the middle of the forward's, and collectives run in one order on every
rank. So a tensor-parallel prefill hands prompts off whole (``prefill/layerwise.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from crescent.services.engine.kv_cache import PagedKvCache
from crescent.services.kvwire.layer_wire import LayerLayout
from crescent.services.engine.parallel.group import Command, TpGroup

KV_HEADS_AXIS = 3  # of a payload: (layers, 2, tokens, kv_heads, head_dim)


class ShardedKvCache:
    """``PagedKvCache``'s interface over the group's shards (see the module docstring)."""

    def __init__(self, local: PagedKvCache, group: TpGroup, total_kv_heads: int) -> None:
        self.local = local
        self.group = group
        self.pages = local.pages
        self.block_size = local.block_size
        layers, two, block_size, _, head_dim = local.block_shape
        self._block_shape = (layers, two, block_size, total_kv_heads, head_dim)

    @property
    def wire_dtype(self) -> torch.dtype:
        return self.local.wire_dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one page's payload, all KV heads: (layers, 2, block_size, kv_heads, head_dim)."""
        return self._block_shape

    @property
    def capacity_tokens(self) -> int:
        return self.local.capacity_tokens

    def page_bytes(self) -> int:
        return self.local.page_bytes() * self.group.size

    def nbytes(self) -> int:
        """The whole instance's KV bytes, all ranks together."""
        return self.local.nbytes() * self.group.size

    def payload_shape(self, num_tokens: int) -> tuple[int, ...]:
        layers, two, _, heads, dim = self._block_shape
        return (layers, two, num_tokens, heads, dim)

    def payload_tokens(self, shape: Sequence[int]) -> int:
        shape = tuple(shape)
        if len(shape) != 5 or not 0 < shape[2] <= self.block_size or self.payload_shape(shape[2]) != shape:
            raise ValueError(f"KV payload shape {shape} does not fit pages of shape {self._block_shape}")
        return shape[2]

    @property
    def num_layers(self) -> int:
        return self._block_shape[0]

    def token_layer_bytes(self) -> int:
        """One token's bytes of one layer in a payload (all KV heads)."""
        _, two, _, heads, dim = self._block_shape
        return two * heads * dim * self.local.pool.element_size()

    def layer_layout(self) -> LayerLayout:
        """A payload's layers, as a one-process cache lays them out (receiving layer-wise handoffs)."""
        return LayerLayout.layer_major(self.num_layers, self.token_layer_bytes())

    def read_block(self, page: int, num_tokens: int | None = None) -> torch.Tensor:
        """The page's first ``num_tokens`` tokens (all by default), every rank's heads: a new tensor."""
        tokens = self.block_size if num_tokens is None else num_tokens
        with self.group.command(Command.READ, page, tokens):
            parts = self.group.gather(self.local.read_block(page, tokens).contiguous())
        assert parts is not None
        return torch.cat(parts, dim=KV_HEADS_AXIS)

    def write_block(self, page: int, payload: torch.Tensor) -> None:
        """Copy a (possibly partial) full-layout payload into ``page`` of every rank."""
        tokens = self.payload_tokens(payload.shape)
        parts = [p.contiguous() for p in payload.to(self.wire_dtype).chunk(self.group.size, dim=KV_HEADS_AXIS)]
        with self.group.command(Command.WRITE, page, tokens):
            mine = torch.empty_like(parts[0])
            self.group.scatter(mine, parts)
        self.local.write_block(page, mine)
