"""A preallocated host-memory arena for the DRAM tier, cut into pages.

Fresh memory is slow to touch on a VM (every page faults), so the tier's bytes are mapped once
(and, with ``prefault``, touched at start) and reused for the life of the process. Each block takes one contiguous
run of pages, so it can be handed out as a zero-copy ``memoryview``; free runs are kept sorted
and merged, and allocation is first-fit. When no run is long enough the tier asks the store to
evict more (``fits``), so fragmentation costs evictions, never correctness.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
from typing import Any

from crescent.services.kvstore.shm import file_identity

log = logging.getLogger(__name__)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class HostPool:
    def __init__(
        self, capacity_bytes: int, page_bytes: int, *, pinned: bool = False, shared: bool = False, prefault: bool = False
    ) -> None:
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        self.page_bytes = page_bytes
        self.pages = capacity_bytes // page_bytes
        self.size = self.pages * page_bytes
        self._keepalive: Any = None
        self._fd: int | None = None
        self.share_path = ""  # same-host clients map the pool from here
        self.share_identity = ""  # and check that they opened this very file
        self._flags = _POPULATE if prefault else 0
        self.buf = self._allocate(self.size, pinned, shared)
        self._starts: list[int] = [0] if self.pages else []  # free runs, sorted by start page
        self._lengths: dict[int, int] = {0: self.pages} if self.pages else {}
        self.free_pages = self.pages

    def _allocate(self, size: int, pinned: bool, shared: bool) -> memoryview:
        if size == 0:
            return memoryview(b"")
        if shared and hasattr(os, "memfd_create"):
            # An anonymous file: nothing is left behind in /dev/shm if the process dies, and a
            # client of the same user opens it through /proc/<pid>/fd/<fd>.
            self._fd = os.memfd_create("crescent-kv-pool", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, size)
            area = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | self._flags)
            self._keepalive = area
            self.share_path = f"/proc/{os.getpid()}/fd/{self._fd}"
            self.share_identity = file_identity(self._fd)
            return memoryview(area)
        if pinned:  # page-locked, so copies to and from the GPU run at full speed
            import torch

            tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._keepalive = tensor
            return memoryview(tensor.numpy())
        area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | self._flags)
        self._keepalive = area
        return memoryview(area)

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes)

    def largest_run(self) -> int:
        return max(self._lengths.values(), default=0)

    def can_allocate(self, nbytes: int) -> bool:
        need = self.pages_for(nbytes)
        return need == 0 or any(length >= need for length in self._lengths.values())

    def allocate(self, nbytes: int) -> int | None:
        """Start page of a run holding ``nbytes``, or None when no run is long enough."""
        need = self.pages_for(nbytes)
        if need == 0:
            return 0
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length >= need:
                del self._lengths[start]
                if length == need:
                    del self._starts[i]
                else:
                    self._starts[i] = start + need
                    self._lengths[start + need] = length - need
                self.free_pages -= need
                return start
        return None

    def release(self, start: int, nbytes: int) -> None:
        count = self.pages_for(nbytes)
        if count == 0:
            return
        i = bisect.bisect_left(self._starts, start)
        # merge with the run after, then with the run before
        if i < len(self._starts) and self._starts[i] == start + count:
            count += self._lengths.pop(self._starts[i])
            del self._starts[i]
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == start:
            prev = self._starts[i - 1]
            self._lengths[prev] += count
        else:
            self._starts.insert(i, start)
            self._lengths[start] = count
        self.free_pages += self.pages_for(nbytes)

    def offset_of(self, start: int) -> int:
        return start * self.page_bytes

    def view(self, start: int, nbytes: int) -> memoryview:
        offset = start * self.page_bytes
        return self.buf[offset : offset + nbytes]
