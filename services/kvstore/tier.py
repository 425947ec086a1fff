"""What every tier offers the store, and the host-memory tier.

A tier holds bytes and an index of what it holds; it does not decide what to evict (the store's
policy does) and does not verify what it returns (the store does, for tiers with ``verify_reads``).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass

from crescent.protos import common_pb2
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import KvBlock, meta_of
from crescent.services.kvstore.config import HostTierSettings, TierSettings
from crescent.services.kvstore.host_pool import HostPool

TIER_LABELS = {
    common_pb2.KV_TIER_GPU: "gpu",
    common_pb2.KV_TIER_HOST: "host",
    common_pb2.KV_TIER_DISK: "disk",
    common_pb2.KV_TIER_S3: "s3",
}


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What a tier knows about a block without reading it."""

    nbytes: int
    parent_key: BlockKey | None = None
    model_id: str = ""
    num_tokens: int = 0

    @classmethod
    def of(cls, block: KvBlock) -> BlockInfo:
        return cls(block.nbytes, block.parent_key, block.model_id, block.num_tokens)


class StorageTier(abc.ABC):
    """A store of whole blocks with a byte capacity and watermarks."""

    kind: int = common_pb2.KV_TIER_UNSPECIFIED
    # Whether the store checks every block this tier returns. Off only for memory this process
    # owns and checked on the way in; every client still verifies what it receives.
    verify_reads: bool = True
    reserved_bytes: int = 0  # room promised to writers filling it in place (host tier only)
    spill_target: bool = False  # outlives the process and takes writes fast: the host tier spills here at stop

    def __init__(self, settings: TierSettings) -> None:
        self.capacity_bytes = settings.capacity_bytes
        self.high_watermark = settings.high_watermark
        self.low_watermark = settings.low_watermark
        self._index: dict[BlockKey, BlockInfo] = {}
        self.used_bytes = 0
        self._unreadable = 0  # corrupt copies this tier found and deleted by itself (re-indexing)

    @property
    def label(self) -> str:
        return TIER_LABELS[self.kind]

    def take_unreadable(self) -> int:
        """Corrupt copies found and deleted since the last call (the store counts them)."""
        found, self._unreadable = self._unreadable, 0
        return found

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def info(self, key: BlockKey) -> BlockInfo | None:
        return self._index.get(key)

    def items(self) -> Iterator[tuple[BlockKey, BlockInfo]]:
        return iter(list(self._index.items()))

    def effective_capacity(self) -> int:
        """Capacity now; a tier that hit a hard limit (disk full) reports less."""
        return self.capacity_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether a write of ``nbytes`` would succeed now, space-wise."""
        return self.used_bytes + nbytes <= self.effective_capacity()

    def _indexed(self, key: BlockKey, info: BlockInfo) -> None:
        old = self._index.pop(key, None)
        if old is not None:
            self.used_bytes -= old.nbytes
        self._index[key] = info
        self.used_bytes += info.nbytes

    def _unindexed(self, key: BlockKey) -> bool:
        old = self._index.pop(key, None)
        if old is None:
            return False
        self.used_bytes -= old.nbytes
        return True

    async def start(self) -> None:
        """Open resources and rebuild the index of a persistent tier."""

    async def close(self) -> None:
        """Flush pending work and release resources."""

    @abc.abstractmethod
    async def write(self, block: KvBlock) -> bool:
        """Store a block (room was made by the caller); False when the tier could not take it."""

    @abc.abstractmethod
    async def read(self, key: BlockKey) -> KvBlock | None:
        """The stored block, unverified, or None."""

    @abc.abstractmethod
    async def delete(self, key: BlockKey) -> bool:
        """Drop a block; False when the tier did not hold it."""


@dataclass(frozen=True, slots=True)
class SpaceReservation:
    """Room in the host pool for one block not yet stored: whoever holds it writes the payload
    into ``view`` in place, then the store ``commit``s or ``release``s it."""

    start: int  # first page
    nbytes: int
    view: memoryview


class HostTier(StorageTier):
    """Host DRAM: payloads live in a preallocated ``HostPool`` and are served from it as
    zero-copy views. A view stays valid only while its block is held: readers that await
    between reading and using it pin the key in the store first.

    Writers can also fill the pool in place: ``reserve`` room, write into its view, ``adopt``
    it as a block (a gRPC put stream and same-host clients do, to save a copy)."""

    kind = common_pb2.KV_TIER_HOST
    verify_reads = False

    def __init__(self, settings: HostTierSettings, *, pinned: bool = False, shared: bool = False) -> None:
        super().__init__(settings)
        self.pool = HostPool(
            settings.capacity_bytes, settings.page_bytes, pinned=pinned, shared=shared, prefault=settings.prefault,
            huge_pages=settings.huge_pages,
        )
        # block (payload in the pool), start page, its header (built once: same-host reads send it)
        self._blocks: dict[BlockKey, tuple[KvBlock, int, common_pb2.BlockMeta]] = {}
        self.reserved_bytes = 0

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + self.reserved_bytes + nbytes <= self.capacity_bytes and self.pool.can_allocate(nbytes)

    def _keep(self, block: KvBlock, start: int) -> None:
        view = self.pool.view(start, block.nbytes).toreadonly()
        stored = KvBlock(block.key, block.parent_key, block.model_id, block.dtype, block.shape,
                         block.token_ids, view, block.checksum, block.format_version)
        self._blocks[block.key] = (stored, start, meta_of(stored))
        self._indexed(block.key, BlockInfo.of(block))

    async def write(self, block: KvBlock) -> bool:
        start = self.pool.allocate(block.nbytes)
        if start is None:
            return False
        self.pool.view(start, block.nbytes)[:] = block.payload
        self._keep(block, start)
        return True

    def reserve(self, nbytes: int) -> SpaceReservation | None:
        """Room for ``nbytes`` (the store made it), or None when no run of pages is long enough."""
        start = self.pool.allocate(nbytes)
        if start is None:
            return None
        self.reserved_bytes += nbytes
        return SpaceReservation(start, nbytes, self.pool.view(start, nbytes))

    def release(self, reservation: SpaceReservation) -> None:
        self.reserved_bytes -= reservation.nbytes
        self.pool.release(reservation.start, reservation.nbytes)

    def adopt(self, block: KvBlock, reservation: SpaceReservation) -> None:
        """Index ``block``, whose payload was written into ``reservation``."""
        if block.nbytes != reservation.nbytes:
            raise ValueError(f"a block of {block.nbytes} bytes in a reservation of {reservation.nbytes}")
        self.reserved_bytes -= reservation.nbytes
        self._keep(block, reservation.start)

    async def read(self, key: BlockKey) -> KvBlock | None:
        entry = self._blocks.get(key)
        return entry[0] if entry is not None else None

    def pool_offset(self, key: BlockKey) -> int | None:
        """Where the block's payload starts in the pool, for same-host readers."""
        entry = self._blocks.get(key)
        return self.pool.offset_of(entry[1]) if entry is not None else None

    def meta(self, key: BlockKey) -> common_pb2.BlockMeta | None:
        entry = self._blocks.get(key)
        return entry[2] if entry is not None else None

    async def delete(self, key: BlockKey) -> bool:
        entry = self._blocks.pop(key, None)
        if entry is not None:
            self.pool.release(entry[1], entry[0].nbytes)
        return self._unindexed(key)
