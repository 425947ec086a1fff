"""``crescent keys create --rpm … / keys limits`` and the ``rate_limits`` table, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from crescent.services.tenancy import KeyStore, TenancyError, connect_database
from crescent.services.tenancy.limits import LimitBook, Limits, Subject
from tests.tenancy.postgres import postgres_server
from tests.tenancy.test_keys_cli import keys, rows

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/gateway.sqlite3"
    else:
        with postgres_server() as url:
            yield url


def test_limits_set_at_creation_then_changed_and_cleared(database_url: str) -> None:
    created = keys(database_url, "create", "acme", "--rpm", "60", "--budget-usd", "12.345678901")
    assert created.returncode == 0, created.stderr
    key_id = rows(keys(database_url, "list").stdout)[0]["id"]
    shown = rows(keys(database_url, "limits", key_id).stdout)
    assert shown == [{"subject": f"key {key_id}", "rpm": "60", "tpm": "default", "max_concurrent": "default",
                      "budget_usd": "12.345678901"}]
    changed = rows(keys(database_url, "limits", key_id, "--tpm", "90000", "--clear", "rpm").stdout)[0]
    assert (changed["rpm"], changed["tpm"], changed["budget_usd"]) == ("default", "90000", "12.345678901")
    tenant = rows(keys(database_url, "limits", "--tenant", "acme", "--max-concurrent", "8").stdout)[0]
    assert tenant["subject"].startswith("tenant ten_") and tenant["max_concurrent"] == "8"

    book = LimitBook(KeyStore(connect_database(database_url)))
    key_limits, tenant_limits = book.for_request(tenant["subject"].split()[1], key_id)
    assert key_limits == Limits(None, 90000, None, Decimal("12.345678901"))
    assert tenant_limits == Limits(max_concurrent=8)
    assert key_limits.over(Limits(rpm=5, tpm=1)) == Limits(5, 90000, None, Decimal("12.345678901"))


def test_bad_limits_are_refused_before_a_key_is_made(database_url: str) -> None:
    refused = keys(database_url, "create", "acme", "--budget-usd", "-1")
    assert refused.returncode == 1 and "budget_usd must not be negative" in refused.stderr
    assert rows(keys(database_url, "list").stdout) == []
    assert keys(database_url, "create", "acme", "--rpm", "0").returncode != 0
    missing = keys(database_url, "limits", "key_nope", "--rpm", "5")
    assert missing.returncode == 1 and "no key 'key_nope'" in missing.stderr
    with pytest.raises(TenancyError, match="unknown limit 'rpn'"):
        LimitBook(KeyStore(connect_database(database_url))).update(Subject("tenant", "default"), rpn=5)
