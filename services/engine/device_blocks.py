"""A prompt's full KV blocks as device tensors of their own, for the kvstore's GPU tier.

When the KV pool is on a GPU and the node's GPU tier is on the same GPU, prefill's kvstore export
puts each new block's device bytes (``KvStoreClient.put_device``: CUDA IPC, device to device) and
its prefix load gets cached blocks into device rooms (``get_device``) that ``Engine.attach_blocks``
copies into pool pages; neither builds host bytes (``services/prefill/device_store.py`` drives it,
docs/cuda.md "The kvstore's GPU tier without a host bounce").

- **gather**: each block's payload, exactly what the host export stores for it
  (``Engine.block_payload``), is copied into a room of its own size (queued on the engine thread
  after the forward that wrote it), so the page can go back to the pool at once, however long the
  node takes, and the node opens a small region rather than the whole pool. A Llama block is one
  page (one device-to-device copy); a kimi_k3 block is its latents, with the state snapshot (or
  the live state) in front where the host export puts one: the cache assembles it on the device
  and it is copied once more into its room;
- **rooms** come from ``DeviceRooms``: where the client's ``RegionOpener`` can export them
  (``CudaRooms``: ``torch.empty`` on the pool's device; a CPU test: the shared-memory stand-in of
  ``tests/kvstore/ipc_stand_in.py``, the seam this module exists to keep);
- **sizes on a load**: a room is first ``block_bytes`` (a full block without a state: all of a
  Llama block); a kimi_k3 block with a state does not fit, so the node leaves that room alone and
  says the block's shape, and the block is got again into a room of that size
  (``services/prefill/device_store.py``): no room ever sized for a state a block may not have;
- **which caches**: a Llama pool (``PagedKvCache``) or a kimi_k3 cache (``StatefulKvCache``) on
  CUDA. ``for_cache`` gives None on the CPU (nothing changes there, no device tensor is made) and
  for a tensor-parallel leader's cache (its layers are spread over the group).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

import torch

from crescent.services.engine.cache_api import KvCache, StatefulKvCache
from crescent.services.engine.kv_cache import PagedKvCache

if TYPE_CHECKING:
    from crescent.services.engine.engine import Engine, Sequence


class DeviceRooms(Protocol):
    """Device memory the kvstore client's ``RegionOpener`` can export."""

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A contiguous ``uint8`` tensor of ``nbytes`` on the pool's device."""
        ...

    def free(self, rooms: Seq[torch.Tensor]) -> None:
        """``rooms`` are read and written no more (the node's copy is done when its reply came)."""
        ...


class CudaRooms:
    """Rooms from torch's caching allocator. Freed rooms stay in torch's IPC limbo until the node
    has let its handle go (torch's IPC ref counter), then return to the allocator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def free(self, rooms: Seq[torch.Tensor]) -> None:
        pass  # dropping the last reference is enough


class DeviceBlocks:
    """Full blocks of one cache gathered into device rooms, and rooms as the cache's payloads."""

    def __init__(self, cache: KvCache, rooms: DeviceRooms) -> None:
        self.cache = cache
        self._rooms = rooms
        self.stateful = isinstance(cache, StatefulKvCache)
        # a full block without a state: a Llama block, a kimi_k3 block's latents
        self.block_bytes = math.prod(cache.block_shape) * cache.wire_dtype.itemsize

    @staticmethod
    def for_cache(cache: object) -> DeviceBlocks | None:
        """The device path for ``cache``: a Llama pool or a kimi_k3 cache on CUDA; None anywhere
        else (the CPU included)."""
        if isinstance(cache, StatefulKvCache):
            pass  # kimi_k3: blocks with or without a state, sized per block
        elif not isinstance(cache, PagedKvCache):
            return None
        device = torch.device(cache.device)
        if device.type != "cuda":
            return None
        return DeviceBlocks(cache, CudaRooms(device))

    def rooms(self, count: int, nbytes: int | None = None) -> list[torch.Tensor]:
        """``count`` rooms of ``nbytes`` each (default: one full block without a state)."""
        size = self.block_bytes if nbytes is None else nbytes
        made: list[torch.Tensor] = []
        try:
            for _ in range(count):
                made.append(self._rooms.alloc(size))
        except BaseException:
            self.free(made)
            raise
        return made

    def free(self, rooms: Seq[torch.Tensor]) -> None:
        if rooms:
            self._rooms.free(rooms)

    def payload(self, room: torch.Tensor, shape: Seq[int] | None = None) -> torch.Tensor:
        """A room seen as a block's payload of ``shape`` (default ``cache.block_shape``), the
        cache's dtype, no copy (the room is that payload's size: ``room_holds``)."""
        return room.view(self.cache.wire_dtype).view(tuple(self.cache.block_shape if shape is None else shape))

    def attachable(self, payloads: Seq[torch.Tensor]) -> int:
        """How many of ``payloads`` (the sequence's next blocks) ``Engine.attach_blocks`` takes:
        all of a Llama pool's; a kimi_k3 sequence's up to its last block with a state (it
        resumes there; the blocks after wait for a later state, or are left)."""
        if not self.stateful:
            return len(payloads)
        carrying = [i for i, p in enumerate(payloads) if self.cache.payload_has_state(p.shape)]
        return carrying[-1] + 1 if carrying else 0

    def gather(self, engine: Engine, seq: Sequence, indices: Seq[int]) -> list[torch.Tensor]:
        """Full blocks ``indices`` of ``seq``, each copied into a room of its own size and seen as
        its payload (the host export's shape and bytes: ``Engine.block_payload``). Engine thread:
        stream-ordered after the forwards that wrote them."""
        gathered: list[torch.Tensor] = []
        try:
            for index in indices:
                block = engine.block_payload(seq, index)
                room = self._rooms.alloc(block.numel() * block.element_size())
                gathered.append(self.payload(room, block.shape))
                gathered[-1].copy_(block)
        except BaseException:
            self.free(gathered)
            raise
        return gathered
