"""Same-host shared memory, the pieces every mover shares: where segments live (``/dev/shm``),
whether this process may make them, and how two processes tell they map the same file.

The kvstore's shared-memory mover (``services/kvstore/shm.py``, ``movers/shared_memory.py``) and
the prefill -> decode handoff through shared memory (``handoff_shm.py``) both use them.
"""

from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def file_identity(fd: int) -> str:
    """"boot id:device:inode" of an open file. Two processes see the same string only for the
    same file under the same running kernel, so a path like /proc/<pid>/fd/<n> that names
    another process's file (another host, another PID namespace) is caught."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    st = os.fstat(fd)
    return f"{boot}:{st.st_dev}:{st.st_ino}"
