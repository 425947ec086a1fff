"""A preallocated host-memory arena for the DRAM tier, cut into pages.

Fresh memory is slow to touch on a VM (every page faults), so the tier's bytes are mapped once
(and, with ``prefault``, touched at start) and reused for the life of the process. With
``huge_pages`` the arena is a memfd of huge pages (2 MiB or 1 GiB, from the kernel's preallocated
pool: what a pod's ``hugepages-*`` resource reserves), so a copy of a multi-MB block walks a few
TLB entries instead of hundreds and no page ever faults after start; too few free huge pages is an
error at start, naming what is free and what is needed. Each block takes one contiguous
run of pages, so it can be handed out as a zero-copy ``memoryview``; free runs are kept sorted
and merged, and allocation is first-fit. When no run is long enough the tier asks the store to
evict more (``fits``), so fragmentation costs evictions, never correctness.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
from pathlib import Path
from typing import Any

from crescent.services.common.settings import SettingsError
from crescent.services.kvwire.shm_files import file_identity

log = logging.getLogger(__name__)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
HUGE_PAGE_BYTES = {"2Mi": 2 << 20, "1Gi": 1 << 30}
_MFD_HUGE = {"2Mi": getattr(os, "MFD_HUGE_2MB", 0), "1Gi": getattr(os, "MFD_HUGE_1GB", 0)}


class HugePagesUnavailable(SettingsError):
    """``huge_pages`` was asked for and the kernel cannot give the arena that many."""


def free_huge_pages(size: str) -> int:
    """Huge pages of ``size`` this process can still take: the kernel's free ones not reserved
    by another mapping, within its cgroup's hugetlb limit (a pod's ``hugepages-*`` resource; past
    it a page faults as SIGBUS instead of failing the mapping). 0 where there are none."""
    huge = HUGE_PAGE_BYTES[size]
    sysfs = Path(f"/sys/kernel/mm/hugepages/hugepages-{huge >> 10}kB")
    try:
        pages = int((sysfs / "free_hugepages").read_text()) - int((sysfs / "resv_hugepages").read_text())
    except (OSError, ValueError):
        return 0
    name = "2MB" if size == "2Mi" else "1GB"
    for limit, used in ((f"hugetlb.{name}.max", f"hugetlb.{name}.current"),  # cgroup v2, then v1
                        (f"hugetlb/hugetlb.{name}.limit_in_bytes", f"hugetlb/hugetlb.{name}.usage_in_bytes")):
        try:
            cap = (Path("/sys/fs/cgroup") / limit).read_text().strip()
            if cap != "max":
                pages = min(pages, (int(cap) - int((Path("/sys/fs/cgroup") / used).read_text())) // huge)
            break
        except (OSError, ValueError):
            continue
    return max(pages, 0)


class HostPool:
    def __init__(
        self, capacity_bytes: int, page_bytes: int, *, pinned: bool = False, shared: bool = False,
        prefault: bool = False, huge_pages: str = "off",
    ) -> None:
        """``huge_pages``: "off", "2Mi" or "1Gi" (not with ``pinned``: page-locking is CUDA's)."""
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        if huge_pages != "off" and huge_pages not in HUGE_PAGE_BYTES:
            raise ValueError(f"huge_pages must be off, 2Mi or 1Gi, got {huge_pages!r}")
        if huge_pages != "off" and pinned:
            raise ValueError("a pinned pool (the GPU tier's staging) cannot be backed by huge pages")
        self.huge_pages = huge_pages
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
        if self.huge_pages != "off":
            return self._allocate_huge(size, shared)
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

    def _allocate_huge(self, size: int, shared: bool) -> memoryview:
        """The arena in huge pages: a memfd (shared or not; same-host clients map it like the
        ordinary one), rounded up to whole huge pages. The kernel takes them from its free pool
        when the memfd is mapped, so a shortfall shows here, not as a SIGBUS on first touch."""
        huge = HUGE_PAGE_BYTES[self.huge_pages]
        mapped = -(-size // huge) * huge
        need, free = mapped // huge, free_huge_pages(self.huge_pages)
        shortfall = HugePagesUnavailable(
            f"tiers.host.huge_pages={self.huge_pages}: the host pool needs {need} huge pages of {self.huge_pages} "
            f"({mapped / 2**30:.2f} GiB) and the machine has {free} free; preallocate them (kernel hugepages= or "
            f"/proc/sys/vm/nr_hugepages; in Kubernetes the pod's hugepages-{self.huge_pages} resource), lower "
            "tiers.host.capacity_bytes, or set tiers.host.huge_pages=off")
        if need > free:
            raise shortfall
        fd = os.memfd_create("crescent-kv-pool", os.MFD_CLOEXEC | os.MFD_HUGETLB | _MFD_HUGE[self.huge_pages])
        try:
            os.ftruncate(fd, mapped)
            area = mmap.mmap(fd, mapped, flags=mmap.MAP_SHARED | self._flags)
        except OSError as exc:  # taken meanwhile, or a cgroup's hugetlb limit below the count
            os.close(fd)
            raise shortfall from exc
        self._fd, self._keepalive = fd, area
        if shared:
            self.share_path = f"/proc/{os.getpid()}/fd/{fd}"
            self.share_identity = file_identity(fd)
        log.info("kvstore host pool: %d huge pages of %s (%.2f GiB)", need, self.huge_pages, mapped / 2**30)
        return memoryview(area)[:size]

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
