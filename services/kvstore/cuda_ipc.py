"""Same-GPU block moves between an engine and the kvstore's GPU tier: CUDA IPC, no host bounce.

When the engine and the kvstore node use one physical GPU, a block need not cross to the host and
back: the engine *exports* the device bytes of a payload as a ``DeviceRegion`` (the storage's
CUDA IPC handle, as ``torch.multiprocessing.reductions.reduce_tensor`` gives it, plus the
payload's byte offset and length), the node *opens* it in its own process and copies device to
device into its GPU tier (``GpuTier.write_from``); a read is the reverse, into a region the engine
exported as room (``GpuTier.read_into``).

- Same GPU means the same physical device: regions carry the GPU's UUID, because
  ``CUDA_VISIBLE_DEVICES`` numbers devices per process (vLLM's IPC weight transfer keys its
  handles by UUID for the same reason) and the opener uses its own index for that UUID.
- Ordering: ``reduce_tensor`` records an event on the exporter's current stream and the opener
  waits for it on its stream before reading, so an engine's queued writes of the block are done
  when the node copies it. The node synchronizes its own copy before it answers, so a read's room
  is filled when the engine sees the reply.
- Lifetime: the exporter keeps the storage alive until the opener lets go (torch's IPC ref
  counter); the node drops an opened region as soon as its copy is done.
- A region on another GPU, a host without CUDA IPC (containers without ``--ipc=host``, MIG,
  some virtualised GPUs) or an opener that fails: ``SameGpuPath`` refuses the mover ``cuda_ipc``
  for that peer through the kvwire ``MoverLadder`` and moves the block through host bytes, as
  ``GpuTier.write``/``read`` always did.

A region travels as bytes (``DeviceRegion.to_bytes``: JSON, never pickle: a peer's bytes must not
run code). ``RegionOpener`` is the seam a CPU test replaces with a shared-memory stand-in.

Wired: an engine's ``KvStoreClient.put_device``/``get_device`` send regions to the node's
``PutRegion``/``GetRegion`` (the client's mover ``cuda_ipc``, ``movers/cuda_ipc.py``) and
``TieredStore.put_from_region``/``get_into`` place them like any put (room, eviction, events,
CRC on the node's copy). ``SameGpuPath`` below is the tier-level helper those RPCs do not need
(the client's ladder refuses per node). The engine's side: ``prefill/device_store.py`` (a
pool on CUDA gathers its new blocks into device rooms and puts them; loads into rooms).
Unverified on a GPU here (none was lent): the real ``CudaIpc`` opener ran nowhere;
``tests/kvstore/test_cuda_ipc.py`` and ``test_cuda_ipc_node.py`` run it when CUDA is available
(``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Protocol

from crescent.services.kvwire.movers import MoverLadder

if TYPE_CHECKING:  # torch is imported where a region is made or opened: the kvstore client and
    import torch   # node import this module without needing it

log = logging.getLogger(__name__)

CUDA_IPC = "cuda_ipc"  # the mover's name in the ladder (host bytes, the fallback, are "grpc"'s)


class IpcRefused(RuntimeError):
    """This process cannot open (or export) a region: another GPU, or IPC unavailable here."""


@dataclass(frozen=True, slots=True)
class DeviceRegion:
    """``nbytes`` bytes at ``offset`` of one device storage of another process, and what torch needs
    to open that storage here (``storage_*``, ``ref_counter_*``, ``event_*``: ``reduce_tensor``'s)."""

    gpu_uuid: str
    handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    offset: int
    nbytes: int
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes | None = None
    event_sync_required: bool = False

    def to_bytes(self) -> bytes:
        fields = asdict(self)
        for name in ("handle", "ref_counter_handle", "event_handle"):
            if fields[name] is not None:
                fields[name] = base64.b64encode(fields[name]).decode()
        return json.dumps(fields, sort_keys=True).encode()

    @staticmethod
    def from_bytes(data: bytes) -> DeviceRegion:
        try:
            fields = json.loads(data)
            for name in ("handle", "ref_counter_handle", "event_handle"):
                if fields[name] is not None:
                    fields[name] = base64.b64decode(fields[name])
            region = DeviceRegion(**fields)
        except (ValueError, TypeError, KeyError) as exc:
            raise IpcRefused(f"not a device region: {exc}") from exc
        if region.offset < 0 or region.nbytes < 0:
            raise IpcRefused(f"a device region of {region.nbytes} bytes at {region.offset}")
        return region


class RegionOpener(Protocol):
    """How device memory is shared between processes (CUDA IPC; a test's shared memory)."""

    def gpu_uuid(self, device: torch.device) -> str:
        """The physical identity of ``device`` (equal across processes that see the same GPU)."""
        ...

    def export(self, tensor: torch.Tensor) -> DeviceRegion:
        """A region of ``tensor``'s bytes (contiguous) that another process can open."""
        ...

    def open(self, region: DeviceRegion, device: torch.device) -> torch.Tensor:
        """The region as a ``uint8`` tensor on ``device`` of this process; raises ``IpcRefused``."""
        ...


class CudaIpc:
    """CUDA IPC through torch's own reductions (the handles torch.multiprocessing sends)."""

    def gpu_uuid(self, device: torch.device) -> str:
        import torch

        return str(torch.cuda.get_device_properties(device).uuid)

    def export(self, tensor: torch.Tensor) -> DeviceRegion:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        if tensor.device.type != "cuda" or not tensor.is_contiguous():
            raise IpcRefused(f"a {tensor.device} tensor (contiguous: {tensor.is_contiguous()}) has no CUDA IPC handle")
        flat = tensor.view(-1).view(torch.uint8)
        try:
            _, args = reduce_tensor(flat)
        except RuntimeError as exc:  # e.g. memory from an allocator without IPC support
            raise IpcRefused(f"torch cannot export this device memory: {exc}") from exc
        (_, _, _, offset, _, _, device, handle, storage_bytes, storage_offset_bytes, _,
         ref_handle, ref_offset, event_handle, event_sync) = args
        return DeviceRegion(self.gpu_uuid(torch.device("cuda", device)), bytes(handle), storage_bytes,
                            storage_offset_bytes, offset, flat.numel(), bytes(ref_handle), ref_offset,
                            None if event_handle is None else bytes(event_handle), bool(event_sync))

    def open(self, region: DeviceRegion, device: torch.device) -> torch.Tensor:
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if self.gpu_uuid(device) != region.gpu_uuid:
            raise IpcRefused(f"region on GPU {region.gpu_uuid}, this tier on {self.gpu_uuid(device)}")
        if region.offset + region.nbytes > region.storage_bytes:
            raise IpcRefused(f"region [{region.offset}, +{region.nbytes}) past its storage of "
                             f"{region.storage_bytes} bytes")
        try:
            # the index is ours for that UUID (vLLM's IPC weight transfer does the same)
            return rebuild_cuda_tensor(torch.Tensor, (region.nbytes,), (1,), region.offset, torch.storage.TypedStorage,
                                       torch.uint8, device.index or 0, region.handle, region.storage_bytes,
                                       region.storage_offset_bytes, False, region.ref_counter_handle,
                                       region.ref_counter_offset, region.event_handle, region.event_sync_required)
        except RuntimeError as exc:  # cudaIpcOpenMemHandle refused (no IPC here, MIG, another namespace)
            raise IpcRefused(f"CUDA IPC refused: {exc}") from exc


class SameGpuPath:
    """The node's side of a same-GPU move, with host bytes as the fallback: ``cuda_ipc`` first
    for a peer until it fails once (refused for good in the ladder, logged once), then the host."""

    def __init__(self, tier, ladder: MoverLadder | None = None) -> None:  # noqa: ANN001 - a GpuTier
        self.tier = tier
        self.ladder = ladder if ladder is not None else MoverLadder([CUDA_IPC], what="kvstore gpu tier peer")

    def device_ok(self, peer: str) -> bool:
        return CUDA_IPC in self.ladder.open(peer)

    async def put(self, peer: str, header, region: DeviceRegion | None,  # noqa: ANN001 - a KvBlock
                  host_payload) -> tuple[bool, str]:  # noqa: ANN001
        """Store a block, its bytes from ``region`` on the device, or else from ``host_payload()``
        (a callable: the host bytes are made only when needed). (stored, how: the mover's name)."""
        if region is not None and self.device_ok(peer):
            try:
                stored = self.tier.write_from(header, region)
            except IpcRefused as exc:
                self.ladder.refuse(peer, CUDA_IPC, str(exc))
            else:
                self.ladder.worked(peer, CUDA_IPC)
                self.ladder.moved(peer, CUDA_IPC, "put", region.nbytes)
                return stored, CUDA_IPC
        block = replace(header, payload=host_payload(), payload_crc=None)
        return await self.tier.write(block), "host"

    async def get(self, peer: str, key, room: DeviceRegion | None):  # noqa: ANN001, ANN201
        """(the block's header, "cuda_ipc") with its bytes written into ``room`` on the device, or
        (the whole block with host bytes, "host"), or (None, "") on a miss."""
        if room is not None and self.device_ok(peer):
            try:
                header = self.tier.read_into(key, room)
            except IpcRefused as exc:
                self.ladder.refuse(peer, CUDA_IPC, str(exc))
            else:
                if header is None:
                    return None, ""
                self.ladder.worked(peer, CUDA_IPC)
                self.ladder.moved(peer, CUDA_IPC, "get", room.nbytes)
                return header, CUDA_IPC
        block = await self.tier.read(key)
        return (block, "host") if block is not None else (None, "")
