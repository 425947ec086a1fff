"""Same-host shared memory segments for block payloads (files under /dev/shm, mmapped).

The client creates and owns a segment; the server maps it by name for the length of a call.
Plain files plus mmap instead of ``multiprocessing.shared_memory``: its resource tracker would
unlink a segment the server only attached to.

A segment outlives a client killed before it could unlink it (SIGKILL, OOM). So the owner holds
a shared ``flock`` on its file for as long as it lives, and the first segment a process makes
first removes every segment no live process holds that way (``sweep_stale``). A lock, not a PID:
the kernel drops it with its holder, whatever PID namespace (pod) that was in.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import time
from collections import OrderedDict

from crescent.services.kvwire.shm_files import SHM_DIR

NAME_PREFIX = "crescent-kv-"
_NAME = re.compile(r"^crescent-kv-[0-9a-f]{8,64}$")
log = logging.getLogger(__name__)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
STALE_AFTER_S = 60.0  # a segment younger than this may be between its creation and its owner's lock
_swept = False  # this process has swept once


class ShmError(ValueError):
    """A segment name that is not ours, or a segment that is gone or too small."""


class ShmSegment:
    """A mapped segment. ``create`` makes (and later unlinks) one; ``attach`` maps an existing one."""

    def __init__(self, name: str, size: int, mapping: mmap.mmap, owner: bool, lock_fd: int = -1) -> None:
        self.name, self.size, self.owner = name, size, owner
        self._map = mapping
        self._lock_fd = lock_fd  # the owner's open file, holding its liveness lock
        self.buf = memoryview(mapping)

    @classmethod
    def create(cls, size: int) -> ShmSegment:
        global _swept
        if not _swept:
            _swept = True
            removed = sweep_stale()
            if removed:
                log.info("removed %d kvstore segments that killed clients left in %s", removed, SHM_DIR)
        name = NAME_PREFIX + secrets.token_hex(12)
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            (SHM_DIR / name).unlink(missing_ok=True)
            raise
        return cls(name, size, mapping, owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, name: str) -> ShmSegment:
        if not _NAME.match(name):
            raise ShmError(f"{name!r} is not a kvstore shared memory segment")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except FileNotFoundError:
            raise ShmError(f"shared memory segment {name} does not exist on this host") from None
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(name, size, mapping, owner=False)

    def close(self) -> None:
        try:
            self.buf.release()
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes when it does
        if self.owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def sweep_stale(now: float | None = None) -> int:
    """Remove the segments whose owner is gone (no process holds its lock on them); how many.
    Younger ones are spared: their owner may not have taken its lock yet."""
    now = time.time() if now is None else now
    removed = 0
    for path in SHM_DIR.glob(NAME_PREFIX + "*"):
        if not _NAME.match(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone already, or another user's
        try:
            if now - os.fstat(fd).st_mtime < STALE_AFTER_S:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner lives
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
        finally:
            os.close(fd)
    return removed


class AttachedSegments:
    """The server's cache of mapped client segments, so a hot client costs no mmap per call."""

    def __init__(self, limit: int = 32) -> None:
        self._limit = limit
        self._segments: OrderedDict[str, ShmSegment] = OrderedDict()

    def get(self, name: str) -> ShmSegment:
        segment = self._segments.get(name)
        if segment is not None and (SHM_DIR / name).exists():
            self._segments.move_to_end(name)
            return segment
        if segment is not None:
            self.forget(name)
        segment = ShmSegment.attach(name)
        self._segments[name] = segment
        while len(self._segments) > self._limit:
            _, old = self._segments.popitem(last=False)
            old.close()
        return segment

    def forget(self, name: str) -> None:
        segment = self._segments.pop(name, None)
        if segment is not None:
            segment.close()

    def close(self) -> None:
        for name in list(self._segments):
            self.forget(name)
