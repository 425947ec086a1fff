"""A build lock left by a process killed mid-build must not hang every later engine start."""

from __future__ import annotations

import os
import time
from pathlib import Path

from crescent.kernels.cpu import cpu_ext


def test_a_lock_older_than_any_build_is_removed_and_a_fresh_one_kept(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    cpu_ext._clear_stale_lock(tmp_path)
    assert lock.exists(), "a lock a live build may hold was removed"

    old = time.time() - cpu_ext.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    cpu_ext._clear_stale_lock(tmp_path)
    assert not lock.exists()
    cpu_ext._clear_stale_lock(tmp_path)  # no lock: nothing to do
