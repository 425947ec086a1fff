"""The GPU HBM tier: payloads kept as device tensors (CUDA only; torch imported lazily).

Blocks come and go as host bytes (``write``/``read``), or, from an engine on the same GPU, device
to device through a CUDA IPC region (``write_from``/``read_into``; ``cuda_ipc.py``), which raise
``IpcRefused`` when that cannot work so the caller falls back to host bytes."""

from __future__ import annotations

import dataclasses
from typing import Any

from crescent.protos import common_pb2
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import BlockIntegrityError, KvBlock, expected_nbytes, payload_checksum
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
        ``IpcRefused`` and ``BlockIntegrityError`` as ``copy_from``."""
        copied = self.copy_from(header, region)
        return copied is not None and self.adopt(*copied)

    def copy_from(self, header: KvBlock, region: Any) -> tuple[KvBlock, Any] | None:
        """``header``'s block copied device to device from ``region`` into a tensor of this GPU,
        not yet stored (``adopt`` stores it: the store makes room only for a copy that is good).
        None: out of device memory. Raises ``IpcRefused`` (another GPU, IPC unavailable, a
        region of the wrong size): the caller moves host bytes instead.
        The CRC is computed on the tier's copy after the copy (one device-to-host read of the
        block on the node: there is no CRC kernel on the device): a header checksum of 0 takes
        it (an engine would need host bytes to compute one), any other must match it or
        ``BlockIntegrityError`` is raised and nothing is stored. Either way the copy that later
        leaves the device through ``read`` carries a CRC every reader checks."""
        from crescent.services.kvstore.cuda_ipc import IpcRefused

        want = expected_nbytes(header.dtype, header.shape)
        if region.nbytes != want:
            raise IpcRefused(f"a region of {region.nbytes} bytes for a block of {want}")
        opened = self.opener.open(region, self.device)  # waits (on the device) for the engine's writes
        try:
            tensor = self._torch.empty(region.nbytes, dtype=self._torch.uint8, device=self.device)
        except RuntimeError:  # out of device memory: this tier is full
            return None
        tensor.copy_(opened)
        self._sync()
        del opened  # the engine's storage is its own again
        crc = payload_checksum(tensor.cpu().numpy().tobytes())
        if header.checksum and crc != header.checksum:
            raise BlockIntegrityError(f"block {header.key.hex()}: checksum {crc:#010x} after the device copy, "
                                      f"header says {header.checksum:#010x}")
        return dataclasses.replace(header, checksum=crc, payload=b"", payload_crc=None), tensor

    def adopt(self, header: KvBlock, tensor: Any) -> bool:
        """Store a block ``copy_from`` made (its header, checksummed, and its device tensor)."""
        self._blocks[header.key] = (header, tensor)
        self._indexed(header.key, BlockInfo(tensor.numel(), header.parent_key, header.model_id, header.num_tokens))
        return True

    def header(self, key: BlockKey) -> KvBlock | None:
        """The block's header (empty payload: its shape and dtype give its size), no copy."""
        entry = self._blocks.get(key)
        return None if entry is None else entry[0]

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

    def fill_room(self, room: Any, payload: bytes | memoryview) -> None:
        """Copy host bytes (a block from a slower tier) into an engine's ``room`` on this GPU:
        one host-to-device copy, straight into the engine's memory. Raises ``IpcRefused``."""
        from crescent.services.kvstore.cuda_ipc import IpcRefused

        if room.nbytes != len(payload):
            raise IpcRefused(f"room of {room.nbytes} bytes for a block of {len(payload)}")
        opened = self.opener.open(room, self.device)
        if room.nbytes:
            opened.copy_(self._torch.frombuffer(bytearray(payload), dtype=self._torch.uint8))
        self._sync()
        del opened

    def gpu_uuid(self) -> str:
        return self.opener.gpu_uuid(self.device)

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
