"""KV leaves the device in order: a layer is copied to the host only once its kernels are done.

The engine's per-layer hook (``LlamaModel.forward``'s ``on_layer``) fires when a layer's K and V
writes are *queued*. On the CPU that is when they are done; on a GPU the kernels may still be
running, so a copy started by the hook (the layer-wise handoff, the layer-wise kvstore export,
on the event loop's thread) could read a layer half written. So:

- on the compute thread, right after a layer's K/V writes are queued, ``record(layer)`` puts a
  *fence* on the compute stream (a CUDA event; nothing waits for it there: no host sync inside
  a layer's compute);
- ``copy_out(layer, src, out)``, on the copying thread, orders the copy after the layer's latest
  fence on a separate copy stream (``wait_event``: the GPU waits, not the compute thread), copies
  into pinned host staging, waits for that copy alone, and hands the bytes over.

A copy the compute thread must take at a point of the forward but cannot wait for (a KDA state,
final after the last KDA layer and changed again by the next forward) is ``stage``d: a device-side
copy queued on the compute stream, a fence after it, and ``Staged.copy_into`` on the copying
thread later, ordered after that fence like a layer's copy.

A newer fence of the same layer (the next prefill chunk's) also covers an older one: stream
order. On the CPU the fence is trivially complete and the copy is the plain ``copy_`` it always
was (the same bytes, no extra work). ``Streams`` is the seam a test swaps for a fake device whose
events fire late and in order (tests/engine/test_device_staging.py).

Unverified on a GPU here (no GPU was lent): the CUDA streams, events and pinned staging ran
nowhere yet; the fake-device test proves the ordering logic only.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch


class Fence(Protocol):
    """A point on the compute stream: everything queued before it is done once it has fired."""

    def done(self) -> bool: ...


class Streams(Protocol):
    """What staging needs of a device."""

    def record(self) -> Fence:
        """A fence after what the compute stream has queued so far (compute thread; never blocks)."""
        ...

    def copy(self, after: Fence, src: torch.Tensor, out: torch.Tensor) -> None:
        """Copy device ``src`` into host ``out`` ordered after ``after``; complete on return."""
        ...


class _Complete:
    """The CPU's fence: work is done when it is queued."""

    @staticmethod
    def done() -> bool:
        return True


COMPLETE = _Complete()


class HostStreams:
    """The CPU: no streams, every fence complete, a copy is a copy."""

    def record(self) -> Fence:
        return COMPLETE

    def copy(self, after: Fence, src: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(src)


class CudaStreams:
    """One copy stream per cache and a pinned staging buffer, grown as needed and reused (copies
    come from one thread at a time: the lock only guards that assumption)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device)
        self._staging = torch.empty(0, dtype=torch.uint8, pin_memory=True)
        self._lock = threading.Lock()

    def record(self) -> Fence:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return _CudaFence(event)

    def copy(self, after: Fence, src: torch.Tensor, out: torch.Tensor) -> None:
        assert isinstance(after, _CudaFence), f"a CUDA copy ordered after {after!r}"
        nbytes = src.numel() * src.element_size()
        with self._lock:
            if self._staging.numel() < nbytes:
                self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            staging = self._staging[:nbytes].view(src.dtype).view(src.shape)
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(after.event)  # the copy engine waits for the layer, the host does not
                staging.copy_(src, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._stream)
            copied.synchronize()  # this (copying) thread waits for its own copy, and what it was ordered after
            out.copy_(staging)


class _CudaFence:
    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event.query()


def streams_for(device: torch.device) -> Streams:
    return CudaStreams(device) if device.type == "cuda" else HostStreams()


class DeviceStaging:
    """The latest fence of every layer of one KV pool, and copies out of the pool after them."""

    def __init__(self, num_layers: int, streams: Streams) -> None:
        self.streams = streams
        self._fences: list[Fence] = [COMPLETE] * num_layers

    def record(self, layer: int) -> None:
        """Layer ``layer``'s writes of this forward are queued (compute thread)."""
        self._fences[layer] = self.streams.record()

    def fence(self, layer: int) -> Fence:
        return self._fences[layer]

    def copy_out(self, layer: int, src: torch.Tensor, out: torch.Tensor) -> None:
        """``src`` (a view of layer ``layer`` of the pool, final since its hook fired) into host
        ``out``, once the layer's kernels are done."""
        self.streams.copy(self._fences[layer], src, out)

    def stage(self, copy: torch.Tensor) -> Staged:
        """``copy``, a tensor of its own the compute thread has just queued (a clone of a state that
        the next forward overwrites), held with a fence after it: its host copy is taken later,
        on the copying thread, and the compute thread never waits (compute thread)."""
        return Staged(self.streams, self.streams.record(), copy)


class Staged:
    """A device-side copy and the fence after which it is complete."""

    __slots__ = ("streams", "fence", "tensor")

    def __init__(self, streams: Streams, fence: Fence, tensor: torch.Tensor) -> None:
        self.streams, self.fence, self.tensor = streams, fence, tensor

    def copy_into(self, out: memoryview) -> None:
        """Its bytes into host ``out`` (exactly its size), once its fence fired (copying thread)."""
        dst = torch.frombuffer(out, dtype=self.tensor.dtype).view(self.tensor.shape)
        self.streams.copy(self.fence, self.tensor, dst)
