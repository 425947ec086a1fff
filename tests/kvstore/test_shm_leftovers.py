"""A kvstore client killed before it could unlink its shared memory segment leaves it in
/dev/shm; the next client to make a segment removes it, and never one a live client uses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from crescent.services.kvstore import shm
from crescent.services.kvwire import shm_files

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not shm_files.available(), reason="no writable /dev/shm")]

MAKE_ONE = """
import sys, time
from crescent.services.kvstore.shm import ShmSegment
segment = ShmSegment.create(1 << 20)
print(segment.name, flush=True)
time.sleep(600)
"""


def client_with_a_segment() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", MAKE_ONE], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def backdate(name: str) -> None:
    old = time.time() - 2 * shm.STALE_AFTER_S
    os.utime(shm.SHM_DIR / name, (old, old))


def test_a_killed_clients_segment_is_removed_by_the_next_client_and_a_live_ones_is_kept() -> None:
    killed, killed_name = client_with_a_segment()
    live, live_name = client_with_a_segment()
    young, young_name = client_with_a_segment()
    try:
        for proc in (killed, young):
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        backdate(killed_name)
        backdate(live_name)  # an old segment whose owner still runs
        # a fresh client process: its first segment sweeps before it is made
        nxt, nxt_name = client_with_a_segment()
        nxt.kill()
        nxt.wait(10)
        assert not (shm.SHM_DIR / killed_name).exists()
        assert (shm.SHM_DIR / live_name).exists()
        assert (shm.SHM_DIR / young_name).exists(), "a segment younger than STALE_AFTER_S may not be locked yet"
        backdate(young_name)
        backdate(nxt_name)
        assert shm.sweep_stale() >= 2
        assert not (shm.SHM_DIR / young_name).exists() and not (shm.SHM_DIR / nxt_name).exists()
        assert (shm.SHM_DIR / live_name).exists()
    finally:
        live.kill()
        live.wait(10)
        for name in (killed_name, live_name, young_name):
            (shm.SHM_DIR / name).unlink(missing_ok=True)
