"""A prompt's full KV blocks as device tensors of their own, for the kvstore's GPU tier.

When the KV pool is on a GPU and the node's GPU tier is on the same GPU, prefill's kvstore export
puts each new block's device bytes (``KvStoreClient.put_device``: CUDA IPC, device to device) and
its prefix load gets cached blocks into device rooms (``get_device``) that ``Engine.attach_blocks``
copies into pool pages; neither builds host bytes (``services/prefill/device_store.py`` drives it,
docs/cuda.md "The kvstore's GPU tier without a host bounce").

- **gather**: a full block of the Llama pool is one page, contiguous; it is copied into a room of
  its own (one device-to-device copy, queued on the engine thread after the forward that wrote
  the page), so the page can go back to the pool at once, however long the node takes, and the
  node opens a small region rather than the whole pool;
- **rooms** come from ``DeviceRooms``: where the client's ``RegionOpener`` can export them
  (``CudaRooms``: ``torch.empty`` on the pool's device; a CPU test: the shared-memory stand-in of
  ``tests/kvstore/ipc_stand_in.py``, the seam this module exists to keep);
- **only** the Llama pool (``PagedKvCache``) on CUDA: ``for_cache`` gives None on the CPU (nothing
  changes there, no device tensor is made) and for a hybrid cache (kimi_k3: a block carries a
  state or not, so a room's size is not known before the get; it keeps the host path).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

import torch

from crescent.services.engine.cache_api import StatefulKvCache
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
    """Full blocks of one pool gathered into device rooms, and rooms as the pool's payloads."""

    def __init__(self, cache: PagedKvCache, rooms: DeviceRooms) -> None:
        self.cache = cache
        self._rooms = rooms
        self.block_bytes = math.prod(cache.block_shape) * cache.wire_dtype.itemsize

    @staticmethod
    def for_cache(cache: object) -> DeviceBlocks | None:
        """The device path for ``cache``: a Llama pool on CUDA; None anywhere else (the CPU included)."""
        if not isinstance(cache, PagedKvCache) or isinstance(cache, StatefulKvCache) or cache.device.type != "cuda":
            return None
        return DeviceBlocks(cache, CudaRooms(cache.device))

    def rooms(self, count: int) -> list[torch.Tensor]:
        """``count`` rooms of one full block each."""
        return [self._rooms.alloc(self.block_bytes) for _ in range(count)]

    def free(self, rooms: Seq[torch.Tensor]) -> None:
        self._rooms.free(rooms)

    def payload(self, room: torch.Tensor) -> torch.Tensor:
        """A room seen as a full block's payload (``cache.block_shape``, the pool's dtype), no copy."""
        return room.view(self.cache.wire_dtype).view(self.cache.block_shape)

    def gather(self, engine: Engine, seq: Sequence, indices: Seq[int]) -> list[torch.Tensor]:
        """Full blocks ``indices`` of ``seq``, each copied into a room of its own (engine thread:
        stream-ordered after the forwards that wrote them)."""
        rooms = self.rooms(len(indices))
        try:
            for room, index in zip(rooms, indices):
                self.payload(room).copy_(engine.block_payload(seq, index))
        except BaseException:
            self.free(rooms)
            raise
        return rooms
