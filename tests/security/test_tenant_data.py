"""Tenant data at rest: stored conversations keyed so no id names another tenant's row, and the
databases that hold them (and the salt secret, keys and ledger) readable by their owner only."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import stat
from pathlib import Path

from sqlalchemy import text

from crescent.services.gateway.responses.store import ResponseStore
from crescent.services.tenancy.database import connect_database


def _response(response_id: str) -> dict:
    return {"id": response_id, "created_at": 1.0, "object": "response"}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_no_response_id_names_another_tenants_row(tmp_path: Path) -> None:
    store = ResponseStore(str(tmp_path / "responses.sqlite3"))
    try:
        asyncio.run(store.put("ten_acme", _response("resp_1"), [{"role": "user", "content": "my name is Ada"}]))
        asyncio.run(store.put("default", _response("resp_2"), []))
        for tenant, spelled in (("default", "ten_acme/resp_1"), ("ten_evil", "resp_1"), ("ten_acme", "default/resp_2"),
                                ("ten_acme/resp_1", ""), ("ten_acm", "e/resp_1")):
            assert asyncio.run(store.get(tenant, spelled)) is None, (tenant, spelled)
            assert not asyncio.run(store.delete(tenant, spelled)), (tenant, spelled)
        assert asyncio.run(store.get("ten_acme", "resp_1")).conversation[0]["content"] == "my name is Ada"
        assert asyncio.run(store.get("default", "resp_2")) is not None
    finally:
        store.close()


def test_rows_of_the_old_single_column_table_move_to_their_tenants(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, created_at REAL NOT NULL, response TEXT NOT NULL, "
                "conversation TEXT NOT NULL)")
    old.executemany("INSERT INTO responses VALUES (?, ?, ?, ?)", [
        ("ten_acme/resp_1", 1.0, json.dumps(_response("resp_1")), json.dumps([{"content": "acme's"}])),
        ("resp_2", 2.0, json.dumps(_response("resp_2")), json.dumps([{"content": "default's"}]))])
    old.commit()
    old.close()
    path.chmod(0o644)  # as earlier versions left it
    store = ResponseStore(str(path))
    try:
        assert asyncio.run(store.get("ten_acme", "resp_1")).conversation == [{"content": "acme's"}]
        assert asyncio.run(store.get("default", "resp_2")).conversation == [{"content": "default's"}]
        assert asyncio.run(store.get("default", "ten_acme/resp_1")) is None
    finally:
        store.close()
    assert _mode(path) == 0o600


def test_databases_are_created_readable_by_their_owner_only(tmp_path: Path) -> None:
    responses = ResponseStore(str(tmp_path / "new" / "responses.sqlite3"))
    try:
        asyncio.run(responses.put("default", _response("resp_1"), []))
    finally:
        responses.close()
    engine = connect_database(f"sqlite:///{tmp_path}/gateway.sqlite3")
    with engine.connect() as connection:
        connection.execute(text("SELECT 1"))
    engine.dispose()
    made = [p for p in tmp_path.rglob("*.sqlite3*")]
    assert {p.name for p in made} >= {"responses.sqlite3", "gateway.sqlite3"}
    for path in made:
        assert _mode(path) == 0o600, f"{path.name} is {oct(_mode(path))}"
