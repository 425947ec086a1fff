"""A throwaway PostgreSQL server on loopback for tests (Debian's postgresql package; skipped
when it is not installed: scripts/install_tools.sh installs it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.ports import free_port


def _bindir() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


class PostgresControl:
    """A running test server: its URL, and stop/start for outage tests (same port and data)."""

    def __init__(self, url: str, start: Callable[[], None], stop: Callable[[], None]) -> None:
        self.url = url
        self.start = start
        self.stop = stop


@contextmanager
def postgres_instance() -> Iterator[PostgresControl]:
    """Start a server in a temporary directory; yields its control; stops and removes it."""
    bindir = _bindir()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql, or scripts/install_tools.sh)")
    root = Path(tempfile.mkdtemp(prefix="crescent-pg-"))
    as_postgres: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root: run it as the package's user
        as_postgres = ["runuser", "-u", "postgres", "--"]
        os.chmod(root, 0o755)
        shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", free_port()
    running = [False]

    def run(*args: str) -> None:
        subprocess.run([*as_postgres, *args], check=True, capture_output=True, timeout=120)

    def start() -> None:
        run(str(bindir / "pg_ctl"), "-D", str(data), "-w", "-l", str(root / "server.log"), "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        running[0] = True

    def stop() -> None:
        run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        running[0] = False

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-U", "crescent", "--auth=trust", "-E", "UTF8")
        start()
        try:
            yield PostgresControl(f"postgresql://crescent@127.0.0.1:{port}/postgres", start, stop)
        finally:
            if running[0]:
                stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def postgres_server() -> Iterator[str]:
    """Start a server in a temporary directory; yields its SQLAlchemy URL; stops and removes it."""
    with postgres_instance() as server:
        yield server.url
