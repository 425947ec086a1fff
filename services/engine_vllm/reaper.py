"""vLLM's engine-core and worker processes outlive an instance killed with SIGKILL (they are
re-parented to init and keep their memory and cores). In a pod that is moot — the container's
processes die together — but under ``crescent up``, which restarts a crashed engine, and in tests,
every kill would leak a model's worth of memory. So a vLLM-backed instance forks a small watchdog
before anything else starts: it notes the instance's descendants twice a second and, once the
instance is gone, kills those still running (checked by start time, so a reused pid is never hit).
"""

from __future__ import annotations

import os
import signal
import time


SCAN_S = 0.5


def process_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = process_stat(int(entry))
            if stat is not None:
                parents.setdefault(stat[0], []).append(int(entry))
                starts[int(entry)] = stat[1]
    found: dict[int, int] = {}
    todo = list(parents.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in starts and pid not in found:
            found[pid] = starts[pid]
            todo.extend(parents.get(pid, []))
    return found


def watch_descendants() -> None:
    """Fork the watchdog (call before any thread starts)."""
    parent = os.getpid()
    if os.fork() != 0:
        return
    # The watchdog: signals meant for the instance's group are the instance's to act on.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    me = os.getpid()
    seen: dict[int, int] = {}
    try:
        while os.getppid() == parent:
            seen.update({pid: start for pid, start in descendants(parent).items() if pid != me})
            time.sleep(SCAN_S)
        for pid, start in seen.items():
            stat = process_stat(pid)
            if stat is not None and stat[1] == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    finally:
        os._exit(0)
