"""The engine's C++ CPU ops (``paged_decode.cpp``), compiled once per machine with ``-march=native``.

``make install`` builds them (``python -m crescent.kernels.cpu.cpu_ext``); a process that
finds no build compiles it on first use (``build_guard`` keeps concurrent processes to one
build). The build directory's name hashes the source and its path, the flags, torch's version
and the CPU's feature flags, so a changed source or another CPU never loads a stale binary. Where no compiler
is found the engine runs the plain PyTorch path instead (slower, and its decode rows differ from
the kernel's in the last bits, so one machine's processes must agree: they share the build).
``CRESCENT_CPU_KERNELS=0`` turns the ops off.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@contextlib.contextmanager
def build_guard(where: Path) -> Iterator[None]:
    """One process at a time loads (and, the first time, builds) the ops in ``where``.

    torch's own build lock is a plain file: a process killed mid-build leaves it, and every later
    process would wait on it (a decode killed while compiling blocked its restarts). This guard is
    an flock, which the kernel releases when its holder dies; whoever holds it is the only
    process in torch's build, so a torch lock found then was left by a dead one and goes.
    """
    with open(where / "crescent-build.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = where / "lock"
        if stale.exists():
            log.warning("removing a build lock left by a process that died mid-build: %s", stale)
            stale.unlink(missing_ok=True)
        yield


def build_dir() -> Path:
    digest = hashlib.sha256()
    # The source's path too: torch's build.ninja names it, so two checkouts sharing one build dir
    # would rebuild it for each other on every load (seen: minutes per test run with 7 worktrees).
    for part in (SOURCE.read_bytes(), str(SOURCE.resolve()).encode(), " ".join(FLAGS).encode(),
                 torch.__version__.encode(), sys.version.encode(), _cpu_flags().encode()):
        digest.update(part)
    root = Path(os.environ.get("CRESCENT_KERNEL_CACHE", Path.home() / ".cache" / "crescent" / "kernels"))
    return root / f"paged_decode-{digest.hexdigest()[:16]}"


@functools.cache
def paged_decode_ops() -> ModuleType | None:
    """The compiled module, or None where the ops are off or cannot be built (logged once)."""
    if os.environ.get("CRESCENT_CPU_KERNELS", "1") == "0":
        return None
    from torch.utils import cpp_extension

    # ninja comes from the venv (a dependency); a service started by path may not have it on PATH.
    venv_bin = str(Path(sys.executable).parent)
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    try:
        where = build_dir()
        where.mkdir(parents=True, exist_ok=True)  # a read-only home: the PyTorch path, not a crash
        with build_guard(where):
            return cpp_extension.load(name="crescent_paged_decode", sources=[str(SOURCE)], extra_cflags=FLAGS,
                                      build_directory=str(where), verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, no writable cache: the PyTorch path serves
        log.warning("CPU decode attention kernel unavailable (%s); using the PyTorch path", exc)
        return None


def main() -> None:
    """Build now (``make install``) and say where."""
    ops = paged_decode_ops()
    print(f"paged decode attention: {'built in ' + str(build_dir()) if ops else 'unavailable (PyTorch path)'}")


if __name__ == "__main__":
    main()
