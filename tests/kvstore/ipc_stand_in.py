"""A CPU stand-in for CUDA IPC: "device memory" is POSIX shared memory, a region's handle is its
segment's name, and "the GPU" is a name both processes agree on. It implements ``cuda_ipc``'s
``RegionOpener``, so the node's same-GPU path (open, copy, fall back) runs here as on a GPU."""

from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory

import torch

from crescent.services.kvstore.cuda_ipc import DeviceRegion, IpcRefused

FAKE_GPU = "GPU-fake-0"


class ShmOpener:
    def __init__(self, gpu: str = FAKE_GPU) -> None:
        self.gpu = gpu
        self.opened = 0  # regions opened (a refused peer's are not even tried)
        self._segments: dict[int, shared_memory.SharedMemory] = {}  # data_ptr -> segment (ours, or opened)
        self._own: set[str] = set()  # the segments this process made (and unlinks)

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A "device" tensor another process can open: ``nbytes`` of shared memory."""
        segment = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        tensor = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes)
        self._own.add(segment.name)
        self._segments[tensor.data_ptr()] = segment
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Give back a tensor ``alloc`` made (its name goes now, its memory with its last view)."""
        segment = self._segments.pop(tensor.data_ptr())
        self._own.discard(segment.name)
        segment.unlink()

    def gpu_uuid(self, device: torch.device) -> str:
        return self.gpu

    def export(self, tensor: torch.Tensor) -> DeviceRegion:
        segment = self._segments[tensor.data_ptr()]
        return DeviceRegion(self.gpu, segment.name.encode(), segment.size, 0, 0, tensor.numel() * tensor.element_size())

    def open(self, region: DeviceRegion, device: torch.device) -> torch.Tensor:
        if region.gpu_uuid != self.gpu:
            raise IpcRefused(f"region on GPU {region.gpu_uuid}, this tier on {self.gpu}")
        try:
            segment = shared_memory.SharedMemory(name=region.handle.decode())
        except (FileNotFoundError, ValueError) as exc:
            raise IpcRefused(f"cannot open {region.handle!r}: {exc}") from exc
        if segment.name not in self._own:  # the exporter's to unlink, not ours
            resource_tracker.unregister(segment._name, "shared_memory")
        self.opened += 1
        tensor = torch.frombuffer(segment.buf, dtype=torch.uint8, count=region.nbytes, offset=region.offset)
        self._segments[tensor.data_ptr()] = segment
        return tensor

    def close(self, unlink: bool = False) -> None:
        for segment in self._segments.values():
            try:
                segment.close()
            except BufferError:  # a tensor still views it: the OS unmaps at exit
                pass
            if unlink and segment.name in self._own:
                self._own.discard(segment.name)
                segment.unlink()
        self._segments.clear()
