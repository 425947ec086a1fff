"""A process killed while building the C++ ops must not hold up any later engine start, and two
live processes must not build at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from crescent.kernels.cpu import cpu_ext

pytestmark = pytest.mark.slow  # starts a process playing the builder: `make test-fast` leaves it out

BUILDER = """
import sys, time
from pathlib import Path
from crescent.kernels.cpu import cpu_ext
where = Path(sys.argv[1])
with cpu_ext.build_guard(where):
    (where / "lock").touch()  # torch's own lock, as its build holds it
    print("building", flush=True)
    time.sleep(float(sys.argv[2]))
    (where / "lock").unlink()
"""


def start_builder(where: Path, seconds: float) -> subprocess.Popen[str]:
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(where), str(seconds)], stdout=subprocess.PIPE,
                               text=True)
    assert builder.stdout is not None and builder.stdout.readline().strip() == "building"
    return builder


def enter_guard_in_background(where: Path) -> threading.Event:
    entered = threading.Event()

    def enter() -> None:
        with cpu_ext.build_guard(where):
            entered.set()

    threading.Thread(target=enter, daemon=True).start()
    return entered


def test_a_builder_killed_mid_build_leaves_nothing_that_blocks_the_next(tmp_path: Path) -> None:
    builder = start_builder(tmp_path, 60)
    entered = enter_guard_in_background(tmp_path)
    assert not entered.wait(0.5), "entered the build while a live process was building"
    os.kill(builder.pid, signal.SIGKILL)  # as a supervisor's kill -9 of a decode compiling its ops
    builder.wait()
    assert entered.wait(5), "the next process still waits on the dead builder's lock"
    assert not (tmp_path / "lock").exists(), "torch's stale lock was left, and torch would wait on it"


def test_a_process_waits_for_a_live_build_and_then_goes_on(tmp_path: Path) -> None:
    builder = start_builder(tmp_path, 1.0)
    started = time.monotonic()
    entered = enter_guard_in_background(tmp_path)
    assert entered.wait(10)
    assert time.monotonic() - started > 0.5, "entered while the live build still ran"
    assert builder.wait(5) == 0
