"""The usage ledger's write-ahead journal: a response waits for one ``write``, not a commit.

With ``ledger.journal_dir`` set, a durable ledger appends each row as a JSON line to a file of
its own (one ``os.write``, ~10 µs) before the response's last bytes go out, and commits rows to
the database in the background as before. Data written is in the kernel's page cache, so it
survives a ``kill -9`` of the gateway (not a crash of the machine: no fsync, the same promise as
SQLite's ``synchronous=NORMAL``). A gateway that starts replays the journals it finds whose owner
is gone: inserts are idempotent by request id, so a row committed before the kill stays one row.

Files are segments, ``usage-<random>-<n>.jsonl`` (random: a restarted container's gateway often
has its predecessor's pid), each locked (``flock``) by the gateway writing it,
so gateways sharing a directory never replay each other's live journal. A segment is deleted
once every row in it is committed; the one being written moves on to a new segment when it
grows past ``SEGMENT_BYTES`` and is emptied in place when nothing in it is pending.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from crescent.services.tenancy.usage import UsageRow

log = logging.getLogger(__name__)

SEGMENT_BYTES = 4 * 1024 * 1024


def encode(row: UsageRow) -> bytes:
    fields = asdict(row)
    fields["created_at"] = row.created_at.isoformat()
    return (json.dumps(fields, separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> UsageRow:
    fields = json.loads(line)
    fields["created_at"] = datetime.fromisoformat(fields["created_at"])
    return UsageRow(**fields)


class Segment:
    """One journal file: its descriptor (locked while it is ours) and how many rows wait in it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.pending = 0
        self.size = 0

    def close_and_delete(self) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self.fd)  # the lock goes with it


class Journal:
    """Append rows, mark them committed; ``recover`` hands back the rows of dead gateways."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._name = secrets.token_hex(6)
        self._count = 0
        self._current = self._open_segment()

    @property
    def current_path(self) -> Path:
        return self._current.path

    def _open_segment(self) -> Segment:
        self._count += 1
        path = self.directory / f"usage-{self._name}-{self._count}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return Segment(path, fd)

    def append(self, row: UsageRow) -> Segment:
        """Write ``row`` (durable against the gateway's death on return); its segment, to ``done``."""
        segment = self._current
        line = encode(row)
        os.write(segment.fd, line)
        segment.pending += 1
        segment.size += len(line)
        if segment.size >= SEGMENT_BYTES:
            self._current = self._open_segment()
        return segment

    def done(self, segment: Segment) -> None:
        """One row of ``segment`` is committed."""
        segment.pending -= 1
        if segment.pending:
            return
        if segment is not self._current:
            segment.close_and_delete()
        elif segment.size:
            os.ftruncate(segment.fd, 0)  # O_APPEND: the next row goes to the new end
            segment.size = 0

    def recover(self) -> list[tuple[UsageRow, Segment]]:
        """The rows journaled by gateways that are gone (their files unlocked), each with its
        segment (now ours: deleted once its rows are committed)."""
        found: list[tuple[UsageRow, Segment]] = []
        for path in sorted(self.directory.glob("usage-*.jsonl")):
            if path == self._current.path:
                continue
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live gateway's
                os.close(fd)
                continue
            segment = Segment(path, fd)
            rows = []
            with open(path, "rb") as f:
                for number, line in enumerate(f, 1):
                    try:
                        rows.append(decode(line))
                    except (ValueError, TypeError):  # cut short by the kill, or not ours
                        log.warning("usage journal %s line %d is not a row; skipped", path.name, number)
            if not rows:
                segment.close_and_delete()
                continue
            segment.pending = len(rows)
            found += [(row, segment) for row in rows]
            log.info("usage journal: %d rows of a stopped gateway to commit (%s)", len(rows), path.name)
        return found

    def close(self) -> None:
        """Stop journaling; the current segment is deleted when nothing in it waits."""
        if self._current.pending == 0:
            self._current.close_and_delete()
        else:
            os.close(self._current.fd)
