"""Stored responses (``store: true``) in an embedded SQLite database, for ``previous_response_id``.

Each row keeps a response object as it was returned and the whole conversation that led to it:
the conversation of the response it continued, its own input items, then its output items. A
follow-up reads one row, so deleting a response never breaks the chains built on it.

sqlite3 calls block, so every method here runs in a worker thread (``asyncio.to_thread``); one
connection, opened on first use, is shared under a lock (``:memory:`` lives as long as it).

Responses belong to the tenant that made them: another tenant neither reads, continues nor
deletes them, even knowing the id. Rows are keyed by (tenant id, response id), two columns, so no
response id a client passes can name another tenant's row. Files made before that (one ``id``
column, ``<tenant id>/<response id>`` or a bare id for the ``default`` tenant) are moved over
when first opened. The database file is created readable by its owner only (every stored
conversation is in it).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crescent.services.common.private_files import create_private_file
from crescent.services.tenancy import DEFAULT_TENANT

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenant_responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,       -- the response object, JSON
    conversation TEXT NOT NULL,   -- input items that continue it, JSON list
    PRIMARY KEY (tenant, id)
)
"""
# The single-column table of earlier versions: its rows move to tenant_responses on first open.
_MOVE_OLD_ROWS = """
INSERT OR IGNORE INTO tenant_responses (tenant, id, created_at, response, conversation)
SELECT CASE WHEN instr(id, '/') > 0 THEN substr(id, 1, instr(id, '/') - 1) ELSE ? END,
       CASE WHEN instr(id, '/') > 0 THEN substr(id, instr(id, '/') + 1) ELSE id END,
       created_at, response, conversation FROM responses
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, path: str) -> None:
        self._path = path if path == ":memory:" else str(Path(path).expanduser())
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            if self._path != ":memory:":
                create_private_file(Path(self._path))
            db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
            if self._path != ":memory:":
                db.execute("PRAGMA journal_mode=WAL")  # readers do not wait for a writer
            db.execute(_SCHEMA)
            if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'responses'").fetchone():
                with db:
                    db.execute("BEGIN")
                    db.execute(_MOVE_OLD_ROWS, (DEFAULT_TENANT,))
                    db.execute("DROP TABLE responses")
            self._db = db
        return self._db

    def _put(self, tenant_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._connection().execute(
                "INSERT OR REPLACE INTO tenant_responses (tenant, id, created_at, response, conversation) "
                "VALUES (?, ?, ?, ?, ?)",
                (tenant_id, response["id"], response["created_at"], json.dumps(response),
                 json.dumps(conversation)),
            )

    def _get(self, tenant_id: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._connection().execute(
                "SELECT response, conversation FROM tenant_responses WHERE tenant = ? AND id = ?",
                (tenant_id, response_id)).fetchone()
        return None if row is None else StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def _delete(self, tenant_id: str, response_id: str) -> bool:
        with self._lock:
            return self._connection().execute(
                "DELETE FROM tenant_responses WHERE tenant = ? AND id = ?", (tenant_id, response_id)).rowcount > 0

    async def put(self, tenant_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        await asyncio.to_thread(self._put, tenant_id, response, conversation)

    async def get(self, tenant_id: str, response_id: str) -> StoredResponse | None:
        """``tenant_id``'s stored response (None: no such response, or another tenant's)."""
        return await asyncio.to_thread(self._get, tenant_id, response_id)

    async def delete(self, tenant_id: str, response_id: str) -> bool:
        """True if ``tenant_id`` had such a response."""
        return await asyncio.to_thread(self._delete, tenant_id, response_id)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
