"""What every tier offers the store, and the host-memory tier.

A tier holds bytes and an index of what it holds; it does not decide what to evict (the store's
policy does) and does not verify what it returns (the store does, for every tier).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass

from crescent.protos import common_pb2
from crescent.services.common.block_keys import BlockKey
from crescent.services.common.kv_block import KvBlock
from crescent.services.kvstore.config import TierSettings

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


class Tier(abc.ABC):
    """A store of whole blocks with a byte capacity and watermarks."""

    kind: int = common_pb2.KV_TIER_UNSPECIFIED

    def __init__(self, settings: TierSettings) -> None:
        self.capacity_bytes = settings.capacity_bytes
        self.high_watermark = settings.high_watermark
        self.low_watermark = settings.low_watermark
        self._index: dict[BlockKey, BlockInfo] = {}
        self.used_bytes = 0

    @property
    def label(self) -> str:
        return TIER_LABELS[self.kind]

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


class HostTier(Tier):
    """Host DRAM: blocks kept as the payload objects they arrived in (no extra copy)."""

    kind = common_pb2.KV_TIER_HOST

    def __init__(self, settings: TierSettings) -> None:
        super().__init__(settings)
        self._blocks: dict[BlockKey, KvBlock] = {}

    async def write(self, block: KvBlock) -> bool:
        self._blocks[block.key] = block
        self._indexed(block.key, BlockInfo.of(block))
        return True

    async def read(self, key: BlockKey) -> KvBlock | None:
        return self._blocks.get(key)

    def peek(self, key: BlockKey) -> KvBlock | None:
        """The block without awaiting: the host tier never blocks."""
        return self._blocks.get(key)

    async def delete(self, key: BlockKey) -> bool:
        self._blocks.pop(key, None)
        return self._unindexed(key)
