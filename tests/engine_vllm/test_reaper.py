"""A vLLM-backed instance killed with SIGKILL leaves none of its processes behind (vLLM's engine
core and workers would otherwise run on, re-parented to init: seen here after a kill -9 test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from crescent.services.engine_vllm.reaper import process_stat

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)

PARENT = """
import subprocess, sys, time
from crescent.services.engine_vllm.reaper import watch_descendants
watch_descendants()
child = subprocess.Popen(["sleep", "300"], start_new_session=True)  # its own group: only the watchdog can reach it
print(child.pid, flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    stat = process_stat(pid)
    return stat is not None and "State:\tZ" not in open(f"/proc/{pid}/status").read()


def test_the_descendants_of_a_killed_instance_are_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(1.5)  # the watchdog has scanned at least once
    assert _alive(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the orphaned descendant is gone"


def test_a_live_instance_keeps_its_descendants() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        time.sleep(1.5)
        assert _alive(child)
    finally:
        parent.kill()
        parent.wait()
        time.sleep(1.5)
        if _alive(child):
            os.kill(child, signal.SIGKILL)
