"""The engine's paged KV cache: one pool tensor and the manager of its pages.

Pool layout: (pages, layers, 2, block_size, kv_heads, head_dim). A page holds one KV block
(``block_size`` tokens, all layers), so a block is exported to the kvstore or handed to decode as
one contiguous slice, with no gather.

``PageManager`` owns reference counts and the prefix map. A page whose block is full and keyed
stays in the map after its last user releases it; it then sits in an LRU list of evictable pages
and is reused only when no free page is left. Hits compare the stored token ids as well as the
key, so a hash collision is a miss, never a wrong answer. Every stored/evicted block is recorded
as an event for the scheduler's prefix index.

Pages can also be *promised*: ``reserve`` sets pages aside for a sequence's whole life (decode
reserves prompt + max_tokens when it admits a request), and ``allocate(..., reserved=True)``
draws from that promise, so a sequence growing into its reservation never meets a full cache.
Plain allocations see only the pages nobody was promised.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from crescent.services.contract.block_keys import BlockKey
from crescent.services.engine.device_staging import DeviceStaging, streams_for
from crescent.services.kvwire.layer_wire import LayerLayout


class CacheFullError(RuntimeError):
    """No free or evictable page is left (that was not promised to a reservation)."""


class PageEventKind(Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class PageEvent:
    kind: PageEventKind
    key: BlockKey
    parent_key: BlockKey | None


@dataclass(slots=True)
class _CachedBlock:
    key: BlockKey
    parent_key: BlockKey | None
    token_ids: tuple[int, ...]


class PageManager:
    """Allocation, reference counts and the prefix map of a fixed number of pages."""

    def __init__(self, num_pages: int, on_reset: Callable[[int], None] | None = None) -> None:
        """``on_reset(page)``: called when a page's content stops mattering — it is handed out
        anew, or released while not in the prefix map (a cache with per-page extras, such as the
        hybrid cache's state snapshots, frees them then)."""
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._on_reset = on_reset
        self._refcount = [0] * num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, LRU first
        self._page_block: dict[int, _CachedBlock] = {}
        self._key_page: dict[BlockKey, int] = {}
        self._promised = 0  # pages reserved and not yet drawn
        self.events: list[PageEvent] = []

    @property
    def free_pages(self) -> int:
        """Pages that can be handed out now (free or evictable), promised ones included."""
        return len(self._free) + len(self._evictable)

    @property
    def promised_pages(self) -> int:
        """Pages reserved for sequences and not allocated yet."""
        return self._promised

    @property
    def unpromised_pages(self) -> int:
        """Pages a plain allocation or a new reservation may take."""
        return self.free_pages - self._promised

    def reserve(self, count: int) -> None:
        """Promise ``count`` pages to one sequence; its later ``allocate(reserved=True)`` calls draw on them."""
        if count > self.unpromised_pages:
            raise CacheFullError(
                f"cannot reserve {count} KV pages: {self.unpromised_pages} of {self.num_pages} are not promised"
            )
        self._promised += count

    def unreserve(self, count: int) -> None:
        """Give back the part of a reservation that was never drawn."""
        assert 0 <= count <= self._promised, f"unreserving {count} of {self._promised} promised pages"
        self._promised -= count

    @property
    def cached_blocks(self) -> int:
        return len(self._key_page)

    def allocate(self, count: int, *, reserved: bool = False) -> list[int]:
        """``count`` pages, each with one reference; ``reserved``: drawn from pages promised earlier."""
        if reserved:
            assert count <= self._promised, f"drawing {count} pages from a promise of {self._promised}"
            self._promised -= count
        elif count > self.unpromised_pages:
            raise CacheFullError(f"need {count} KV pages, {self.unpromised_pages} available of {self.num_pages}")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._forget(page)
            if self._on_reset is not None:
                self._on_reset(page)
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def match_prefix(self, keys: Sequence[BlockKey], token_blocks: Sequence[Sequence[int]]) -> list[int]:
        """Pages holding the longest cached prefix of ``keys``; each returned page gains a reference."""
        pages = []
        spare = self.unpromised_pages  # reviving an evictable page must not eat into promises
        for key, tokens in zip(keys, token_blocks, strict=True):
            page = self._key_page.get(key)
            if page is None or self._page_block[page].token_ids != tuple(tokens):
                break
            if self._refcount[page] == 0:
                if spare == 0:
                    break
                spare -= 1
            pages.append(page)
        for page in pages:
            self._acquire(page)
        return pages

    def share(self, pages: Sequence[int]) -> list[int]:
        """Pages already held by one sequence, handed to another as well: each gains a reference."""
        for page in pages:
            assert self._refcount[page] > 0, f"page {page} is not held by anyone"
            self._acquire(page)
        return list(pages)

    def lookup(self, key: BlockKey) -> int | None:
        return self._key_page.get(key)

    def register(self, page: int, key: BlockKey, parent_key: BlockKey | None, token_ids: Sequence[int]) -> bool:
        """Record that ``page`` now holds the full block ``key``; False if another page already does."""
        if key in self._key_page or page in self._page_block:
            return False
        self._page_block[page] = _CachedBlock(key, parent_key, tuple(token_ids))
        self._key_page[key] = page
        self.events.append(PageEvent(PageEventKind.STORED, key, parent_key))
        return True

    def release(self, pages: Sequence[int]) -> None:
        for page in pages:
            assert self._refcount[page] > 0, f"page {page} released more often than acquired"
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if page in self._page_block:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
                    if self._on_reset is not None:
                        self._on_reset(page)

    def drain_events(self) -> list[PageEvent]:
        events, self.events = self.events, []
        return events

    def snapshot(self) -> list[tuple[BlockKey, BlockKey | None]]:
        """Every cached block, for a full resync of the scheduler's index."""
        return [(b.key, b.parent_key) for b in self._page_block.values()]

    def _acquire(self, page: int) -> None:
        if self._refcount[page] == 0:
            self._evictable.pop(page, None)
        self._refcount[page] += 1

    def _forget(self, page: int) -> None:
        block = self._page_block.pop(page, None)
        if block is not None:
            del self._key_page[block.key]
            self.events.append(PageEvent(PageEventKind.REMOVED, block.key, block.parent_key))


class PagedKvCache:
    """The pool tensor plus its ``PageManager``.

    The engine reaches pages only through ``pages`` and the block methods below (``block_shape``,
    ``wire_dtype``, ``payload_shape``, ``payload_tokens``, ``read_block``, ``write_block``, ``nbytes``), so a model
    with another page layout (the hybrid ``kimi_k3`` family) supplies its own cache class with
    the same methods through ``model.make_cache(num_pages, block_size)``.
    """

    def __init__(
        self, num_pages: int, num_layers: int, block_size: int, kv_heads: int, head_dim: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:
        """The pool is allocated on ``device`` (device memory on a GPU) in ``dtype``, the cache dtype."""
        self.block_size = block_size
        self.pool = torch.zeros((num_pages, num_layers, 2, block_size, kv_heads, head_dim), dtype=dtype, device=device)
        self.pages = PageManager(num_pages)
        self.staging = DeviceStaging(num_layers, streams_for(self.pool.device))  # layer copies after their kernels

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype of block payloads (``read_block``/``write_block``): the pool's."""
        return self.pool.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one page's payload: (layers, 2, block_size, kv_heads, head_dim)."""
        return tuple(self.pool.shape[1:])

    @property
    def capacity_tokens(self) -> int:
        return self.pages.num_pages * self.block_size

    def page_bytes(self) -> int:
        return self.pool[0].numel() * self.pool.element_size()

    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def payload_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of a block payload holding the first ``num_tokens`` tokens of a page."""
        layers, two, _, heads, dim = self.block_shape
        return (layers, two, num_tokens, heads, dim)

    def payload_tokens(self, shape: Sequence[int]) -> int:
        """Tokens a payload of ``shape`` holds; ValueError when the shape is not one of ours."""
        shape = tuple(shape)
        if len(shape) != 5 or not 0 < shape[2] <= self.block_size or self.payload_shape(shape[2]) != shape:
            raise ValueError(f"KV payload shape {shape} does not fit pages of shape {self.block_shape}")
        return shape[2]

    def read_block(self, page: int, num_tokens: int | None = None) -> torch.Tensor:
        """The page's first ``num_tokens`` tokens (all of them by default; then a view), on the
        pool's device: a reader that needs host bytes copies it (``prompt_export.owned_bytes``)."""
        if num_tokens is None or num_tokens == self.block_size:
            return self.pool[page]
        return self.pool[page][:, :, :num_tokens].contiguous()

    # ---- a layer at a time (a layer-wise handoff: kvwire/layer_wire.py) -----------------------

    @property
    def num_layers(self) -> int:
        """Layers of a payload, which lie back to back in it (layer 0 first)."""
        return self.pool.shape[1]

    def token_layer_bytes(self) -> int:
        """One token's bytes of one layer in a payload."""
        return self.pool[0, 0, :, 0].numel() * self.pool.element_size()

    def layer_layout(self) -> LayerLayout:
        """Every layer's bytes in one range of a payload, layer 0 first; no states."""
        return LayerLayout.layer_major(self.num_layers, self.token_layer_bytes())

    def copy_layer(self, page: int, layer: int, num_tokens: int, out: memoryview) -> None:
        """Copy layer ``layer`` of the page's first ``num_tokens`` tokens into ``out`` (that
        layer's bytes of a payload). Another thread may compute later layers meanwhile: a
        finished layer's memory is not written again. On a GPU the copy waits for the layer's
        kernels (``layer_written``'s fence), not just for its hook (``device_staging.py``)."""
        _, _, two, _, heads, dim = self.pool.shape
        dst = torch.frombuffer(out, dtype=self.pool.dtype).view(two, num_tokens, heads, dim)
        self.staging.copy_out(layer, self.pool[page, layer, :, :num_tokens], dst)

    def layer_written(self, layer: int) -> None:
        """The forward queued layer ``layer``'s K and V writes (compute thread, before its hook)."""
        self.staging.record(layer)

    def write_block(self, page: int, payload: torch.Tensor) -> None:
        """Copy a (possibly partial) block payload (any device) into ``page``."""
        tokens = self.payload_tokens(payload.shape)
        self.pool[page][:, :, :tokens].copy_(payload)
