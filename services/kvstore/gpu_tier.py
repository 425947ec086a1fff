"""The GPU HBM tier: payloads kept as device tensors (CUDA only; torch imported lazily).

Blocks come and go as host bytes (``write``/``read``), or, from an engine on the same GPU, device
to device through a CUDA IPC region (``write_from``/``read_into``; ``cuda_ipc.py``), which raise
``IpcRefused`` when that cannot work so the caller falls back to host bytes."""

from __future__ import annotations

from typing import Any

from crescent.protos import common_pb2
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import KvBlock, expected_nbytes
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

    def __init__(self, settings: GpuTierSettings, *, device: Any = None, opener: Any = None) -> None:
        """``device``/``opener``: a test's stand-ins for the GPU and CUDA IPC (``cuda_ipc.RegionOpener``)."""
        super().__init__(settings)
        import torch

        from crescent.services.kvstore.cuda_ipc import CudaIpc

        self._torch = torch
        self.device = torch.device("cuda", settings.device) if device is None else torch.device(device)
        self.opener = CudaIpc() if opener is None else opener
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

    def write_from(self, header: KvBlock, region: Any) -> bool:
        """Store ``header``'s block, its payload copied device to device from ``region`` (an
        engine's ``cuda_ipc.DeviceRegion`` on this GPU). False: the tier is full. Raises
        ``IpcRefused`` (another GPU, IPC unavailable): the caller moves host bytes instead.
        Not checksummed here (that would need the bytes on the host): a read that leaves the
        device through ``read`` is verified by the store, as every tier's is."""
        from crescent.services.kvstore.cuda_ipc import IpcRefused

        want = expected_nbytes(header.dtype, header.shape)
        if region.nbytes != want:
            raise IpcRefused(f"a region of {region.nbytes} bytes for a block of {want}")
        opened = self.opener.open(region, self.device)  # waits (on the device) for the engine's writes
        try:
            tensor = self._torch.empty(region.nbytes, dtype=self._torch.uint8, device=self.device)
        except RuntimeError:  # out of device memory: this tier is full
            return False
        tensor.copy_(opened)
        self._sync()
        del opened  # the engine's storage is its own again
        self._blocks[header.key] = (header, tensor)
        self._indexed(header.key, BlockInfo(region.nbytes, header.parent_key, header.model_id, header.num_tokens))
        return True

    def read_into(self, key: BlockKey, room: Any) -> KvBlock | None:
        """Copy the block's payload device to device into ``room`` (an engine's region on this
        GPU); its header (empty payload), or None if the tier does not hold it. Raises
        ``IpcRefused`` as ``write_from``; the room is filled when this returns."""
        from crescent.services.kvstore.cuda_ipc import IpcRefused

        entry = self._blocks.get(key)
        if entry is None:
            return None
        header, tensor = entry
        if room.nbytes != tensor.numel():
            raise IpcRefused(f"room of {room.nbytes} bytes for a block of {tensor.numel()}")
        opened = self.opener.open(room, self.device)
        opened.copy_(tensor)
        self._sync()  # the engine reads the room once we answer
        del opened
        return header

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self._torch.cuda.current_stream(self.device).synchronize()

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
