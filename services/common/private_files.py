"""Files that hold secrets or tenant data (SQLite databases of salts, keys, the ledger and stored
conversations): created readable and writable by their owner only, and
tightened to that if an older version left them open. SQLite gives its ``-wal`` and ``-shm``
files the permissions of the database file, so making the database private first covers them."""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_MODE = 0o600
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


def create_private_file(path: Path) -> Path:
    """``path`` exists, mode 0600 (its directory made if need be); existing side files of a
    SQLite database at ``path`` are tightened too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, PRIVATE_MODE)  # O_CREAT without O_TRUNC: contents kept
    try:
        os.fchmod(fd, PRIVATE_MODE)
    finally:
        os.close(fd)
    for suffix in SQLITE_SIDE_FILES:
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.chmod(PRIVATE_MODE)
    return path
