"""``crescent keys create|list|revoke`` against a real database: SQLite, and PostgreSQL when installed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from crescent.services.tenancy import DEFAULT_TENANT, KeyStore, cache_salt, connect_database, tenant_salt
from crescent.services.tenancy.database import server_secret
from tests.tenancy.postgres import postgres_server


def keys(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "crescent.services.cli", "keys", *args, "--database-url", url],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})


def rows(listing: str) -> list[dict[str, str]]:
    header, *lines = [line.split("\t") for line in listing.strip().splitlines()]
    return [dict(zip(header, line)) for line in lines]


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/gateway.sqlite3"
    else:
        with postgres_server() as url:
            yield url


@pytest.mark.slow
def test_create_list_revoke_round_trip(database_url: str) -> None:
    created = keys(database_url, "create", "acme", "--name", "ci", "--expires-in", "30d")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("crs-") and len(key) >= 40, "stdout is the key alone"
    assert "shown this once" in created.stderr

    listed = rows(keys(database_url, "list").stdout)
    assert len(listed) == 1
    row = listed[0]
    assert (row["tenant"], row["name"], row["status"]) == ("acme", "ci", "active")
    assert key[:12] == row["prefix"].rstrip("…") and key not in keys(database_url, "list").stdout
    assert row["expires"] != "-"

    store = KeyStore(connect_database(database_url))
    assert store.check(key).tenant_id == store.tenant("acme").id
    assert store.check(key + "x").refusal == "unknown"

    revoked = keys(database_url, "revoke", row["id"])
    assert revoked.returncode == 0, revoked.stderr
    assert rows(keys(database_url, "list", "--tenant", "acme").stdout)[0]["status"] == "revoked"
    assert store.check(key).refusal == "revoked"
    assert keys(database_url, "revoke", "key_does_not_exist").returncode == 1

    tenants = rows(keys(database_url, "tenants").stdout)
    assert [t["name"] for t in tenants] == ["acme"]
    store.engine.dispose()


@pytest.mark.slow
def test_only_the_hash_is_stored_and_expiry_is_kept(database_url: str) -> None:
    store = KeyStore(connect_database(database_url))
    created = store.create_key("acme", "short", expires_in=timedelta(seconds=1), create_tenant=True)
    with store.engine.connect() as db:
        dumped = "\n".join(str(r) for r in db.exec_driver_sql("SELECT * FROM api_keys").all())
    assert created.key not in dumped and created.key[12:] not in dumped
    assert store.check(created.key).tenant_id is not None
    time.sleep(1.1)
    assert store.check(created.key).refusal == "expired"
    store.engine.dispose()


@pytest.mark.slow
def test_two_gateways_share_one_salt_secret(database_url: str) -> None:
    """Several gateways on one database derive the same tenant salts (the secret is made once)."""
    first, second = connect_database(database_url), connect_database(database_url)
    assert server_secret(first, "cache_salt") == server_secret(second, "cache_salt")
    KeyStore(first).ensure_tenant(DEFAULT_TENANT)
    assert KeyStore(second).ensure_tenant(DEFAULT_TENANT).id == DEFAULT_TENANT
    first.dispose()
    second.dispose()


def test_salts() -> None:
    secret = b"s" * 32
    a, b = tenant_salt(secret, "ten_a"), tenant_salt(secret, "ten_b")
    assert a != b and tenant_salt(b"t" * 32, "ten_a") != a
    assert cache_salt(a, None) == a
    assert len({cache_salt(a, None), cache_salt(a, ""), cache_salt(a, "x"), cache_salt(b, "x")}) == 4


def test_crescent_up_says_whether_keys_are_required(monkeypatch: pytest.MonkeyPatch) -> None:
    from crescent.services.keys_cli import auth_status

    monkeypatch.delenv("CRESCENT_GATEWAY__AUTH__ENABLED", raising=False)
    assert "API keys: off" in str(auth_status()) and "'default' tenant" in str(auth_status())
    monkeypatch.setenv("CRESCENT_GATEWAY__AUTH__ENABLED", "true")
    assert "API keys: on" in str(auth_status())
