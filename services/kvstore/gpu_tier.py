"""The GPU HBM tier: payloads kept as device tensors (CUDA only; torch imported lazily)."""

from __future__ import annotations

from typing import Any

from crescent.protos import common_pb2
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.kvstore.config import GpuTierSettings
from crescent.services.kvstore.tier import BlockInfo, StorageTier


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class GpuTier(StorageTier):
    kind = common_pb2.KV_TIER_GPU

    def __init__(self, settings: GpuTierSettings) -> None:
        super().__init__(settings)
        import torch

        self._torch = torch
        self.device = torch.device("cuda", settings.device)
        self._blocks: dict[BlockKey, tuple[KvBlock, Any]] = {}  # header (empty payload), device tensor

    async def write(self, block: KvBlock) -> bool:
        torch = self._torch
        try:
            host = torch.frombuffer(bytearray(block.payload), dtype=torch.uint8) if block.nbytes else torch.empty(0, dtype=torch.uint8)
            tensor = host.to(self.device, non_blocking=False)
        except RuntimeError:  # out of device memory: this tier is full
            return False
        header = KvBlock(block.key, block.parent_key, block.model_id, block.dtype, block.shape,
                         block.token_ids, b"", block.checksum, block.format_version)
        self._blocks[block.key] = (header, tensor)
        self._indexed(block.key, BlockInfo.of(block))
        return True

    async def read(self, key: BlockKey) -> KvBlock | None:
        entry = self._blocks.get(key)
        if entry is None:
            return None
        header, tensor = entry
        payload = tensor.cpu().numpy().tobytes()
        return KvBlock(header.key, header.parent_key, header.model_id, header.dtype, header.shape,
                       header.token_ids, payload, header.checksum, header.format_version)

    async def delete(self, key: BlockKey) -> bool:
        self._blocks.pop(key, None)
        return self._unindexed(key)
