"""Process memory settings for moving multi-MB buffers.

On this kind of VM a first touch of fresh memory costs far more than copying into warm memory
(measured: ~1 GB/s vs ~5 GB/s), and glibc returns every large (>= 32 MiB) buffer to the kernel
on free, so each 64 MiB block would be faulted in again. Raising glibc's mmap and trim
thresholds keeps freed buffers in the heap for the next block.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers_warm(mmap_threshold: int = 1 << 30, trim_threshold: int = 2 << 30) -> bool:
    """Best effort; True when glibc accepted both settings (False elsewhere, e.g. musl)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    except (OSError, AttributeError):
        return False
    if not ok:
        log.info("mallopt was refused; large buffers go back to the kernel on free")
    return ok
