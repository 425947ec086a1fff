"""The usage ledger: 1,000 concurrent requests of every kind add up to what their clients were
told, on SQLite and on a real PostgreSQL server (gateway and backend processes); ``GET /v1/usage``
and ``/admin/usage`` (ranges, grouping, CSV, tenant isolation, bad input) on the gateway served
in-process (``in_process.py``); ``crescent usage``."""

from __future__ import annotations

import asyncio
import csv
import io
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from crescent.services.tenancy.pricing import ModelPrices
from tests.tenancy.postgres import postgres_server

from .in_process import InProcessGateway
from .support import REPO_ROOT, FakeBackend, Gateway
from .usage_load import Outcome, send_all

ADMIN_KEY = "admin-" + uuid.uuid4().hex
MODEL = "fake-model"
K3 = ModelPrices()


def _gateway(backend: FakeBackend, directory: Path, database_url: str,
             kind: type[Gateway] = InProcessGateway) -> Gateway:
    gw = kind(directory, backend.address, auth={"enabled": True, "admin_key": ADMIN_KEY, "database_url": database_url})
    gw.start_gateway()
    return gw


@pytest.fixture(scope="module")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('ledger')}/gateway.sqlite3"


@pytest.fixture(scope="module")
def sqlite_gateway(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory, sqlite_url: str) -> Iterator[Gateway]:
    gw = _gateway(backend, tmp_path_factory.mktemp("ledger-gw"), sqlite_url)
    yield gw
    assert gw.stop() == 0


# The 1,000-request load runs on processes, as deployed: served from the test process, the clients,
# the gateway and the fake engines share one interpreter lock, and most placements missed their
# 5 s deadline on the shared 2-core machine (a finding of the test process, not of the gateway).
@pytest.fixture(scope="module")
def load_backend() -> Iterator[FakeBackend]:
    fake = FakeBackend()
    fake.start_backend()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def sqlite_load_gateway(load_backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    directory = tmp_path_factory.mktemp("ledger-load")
    gw = _gateway(load_backend, directory, f"sqlite:///{directory}/gateway.sqlite3", kind=Gateway)
    yield gw
    assert gw.stop() == 0


@pytest.fixture(scope="module")
def postgres_load_gateway(load_backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with postgres_server() as url:
        gw = _gateway(load_backend, tmp_path_factory.mktemp("ledger-pg"), url, kind=Gateway)
        yield gw
        assert gw.stop() == 0


def admin(gw: Gateway, method: str, path: str, body: dict[str, Any] | None = None, **params: str) -> httpx.Response:
    return httpx.request(method, f"{gw.url}/admin{path}", json=body, params=params,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)


def new_key(gw: Gateway, tenant: str) -> tuple[str, str, str]:
    """A new key of ``tenant`` (made if missing): the key, its id, the tenant id."""
    reply = admin(gw, "POST", "/keys", {"tenant": tenant, "create_tenant": True})
    assert reply.status_code == 201, reply.text
    found = reply.json()
    return found["key"], found["id"], found["tenant_id"]


def usage(gw: Gateway, key: str, **params: str) -> httpx.Response:
    return httpx.get(f"{gw.url}/v1/usage", params=params, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def csv_rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def sums(outcomes: list[Outcome]) -> tuple[int, int, int, int]:
    return (sum(len(o.ledger_ids()) for o in outcomes), sum(o.prompt for o in outcomes),
            sum(o.cached for o in outcomes), sum(o.completion for o in outcomes))


@pytest.mark.slow  # 1,000 requests on gateway, backend and PostgreSQL processes
@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_sums_over_1000_concurrent_requests_equal_what_clients_were_told(database: str,
                                                                       request: pytest.FixtureRequest) -> None:
    gw: Gateway = request.getfixturevalue(f"{database}_load_gateway")
    tenant = f"load-{database}"
    (key_a, id_a, tenant_a), (key_b, id_b, _) = new_key(gw, tenant), new_key(gw, tenant)
    key_other, _, _ = new_key(gw, f"{tenant}-other")
    outcomes = asyncio.run(send_all(gw.url, [key_a, key_b, key_other], 1000, MODEL, prefix=f"{database} "))
    assert [o.error for o in outcomes if not o.whole] == []
    assert sum(o.cached for o in outcomes) > 0  # the shared prompts hit the cache

    rows = {r["request_id"]: r for r in csv_rows(admin(gw, "GET", "/usage", format="csv").text)}
    mine = [o for o in outcomes if o.key in (key_a, key_b)]
    for o in outcomes:  # every response's rows add up to the usage its client got
        found = [rows[i] for i in o.ledger_ids()]
        assert {r["status"] for r in found} == {"ok"}
        got = tuple(sum(int(r[c]) for r in found) for c in ("prompt_tokens", "cached_tokens", "completion_tokens"))
        assert got == (o.prompt, o.cached, o.completion), o
        for r in found:  # priced at K3's prices, exactly
            price = K3.price(int(r["prompt_tokens"]), int(r["cached_tokens"]), int(r["completion_tokens"]))
            assert Decimal(r["cost_usd"]) == price
            assert Decimal(r["cache_savings_usd"]) == K3.savings(int(r["cached_tokens"]))
    assert sum(len(o.ledger_ids()) for o in outcomes) == len([r for r in rows if r.split(":")[0] in
                                                              {o.id for o in outcomes}])

    # The tenant's own view: its total, and per key; the other tenant's requests are not in it.
    total = usage(gw, key_a).json()["total"]
    requests, prompt, cached, completion = sums(mine)
    assert (total["requests"], total["prompt_tokens"], total["cached_tokens"], total["completion_tokens"]) == (
        requests, prompt, cached, completion)
    expected_cost = sum(Decimal(rows[i]["cost_usd"]) for o in mine for i in o.ledger_ids())
    assert total["cost_usd"] == pytest.approx(float(expected_cost), rel=1e-12)
    by_key = {g["key"]: g["requests"] for g in usage(gw, key_b, group_by="key").json()["data"]}
    assert by_key == {id_a: sums([o for o in mine if o.key == key_a])[0],
                      id_b: sums([o for o in mine if o.key == key_b])[0]}
    by_tenant = admin(gw, "GET", "/usage", tenant=tenant, group_by="tenant").json()["data"]
    assert [(g["tenant"], g["requests"]) for g in by_tenant] == [(tenant_a, requests)]


@pytest.fixture(scope="module")
def two_tenants(sqlite_gateway: Gateway) -> dict[str, Any]:
    """Tenants A (keys a1, a2) and B (key b) with a few finished requests each."""
    a1, a1_id, a = new_key(sqlite_gateway, "api-a")
    a2, a2_id, _ = new_key(sqlite_gateway, "api-a")
    b1, _, b = new_key(sqlite_gateway, "api-b")
    for key, count in ((a1, 3), (a2, 2), (b1, 4)):
        for i in range(count):
            reply = httpx.post(f"{sqlite_gateway.url}/v1/chat/completions", timeout=30,
                               headers={"Authorization": f"Bearer {key}"},
                               json={"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}],
                                     "max_tokens": 3})
            assert reply.status_code == 200, reply.text
    return {"a1": a1, "a2": a2, "b1": b1, "a": a, "b": b, "a1_id": a1_id, "a2_id": a2_id}


def test_a_tenant_sees_only_its_own_usage(sqlite_gateway: Gateway, two_tenants: dict[str, Any]) -> None:
    t = two_tenants
    assert usage(sqlite_gateway, t["a1"]).json()["total"]["requests"] == 5
    assert usage(sqlite_gateway, t["b1"]).json()["total"]["requests"] == 4
    assert {g["tenant"] for g in usage(sqlite_gateway, t["a2"], group_by="tenant").json()["data"]} == {t["a"]}
    rows = csv_rows(usage(sqlite_gateway, t["b1"], format="csv").text)
    assert len(rows) == 4 and {r["tenant_id"] for r in rows} == {t["b"]}
    # Naming the other tenant is refused, not ignored.
    refused = usage(sqlite_gateway, t["a1"], tenant=t["b"])
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tenant"
    # The admin key reads any tenant, and only through /admin.
    assert admin(sqlite_gateway, "GET", "/usage", tenant="api-b").json()["total"]["requests"] == 4
    assert usage(sqlite_gateway, ADMIN_KEY).status_code == 401
    assert httpx.get(f"{sqlite_gateway.url}/admin/usage", headers={"Authorization": f"Bearer {t['a1']}"}).status_code == 401
    assert admin(sqlite_gateway, "GET", "/usage", tenant="nobody").status_code == 404


def test_grouping_by_key_model_and_day(sqlite_gateway: Gateway, two_tenants: dict[str, Any]) -> None:
    t = two_tenants
    today = datetime.now(UTC).date().isoformat()
    answer = usage(sqlite_gateway, t["a1"], group_by="key,model,day").json()
    assert answer["group_by"] == ["key", "model", "day"]
    groups = {(g["key"], g["model"], g["day"]): g["requests"] for g in answer["data"]}
    assert groups == {(t["a1_id"], MODEL, today): 3, (t["a2_id"], MODEL, today): 2}
    assert answer["total"]["requests"] == 5
    assert answer["total"]["cost_usd"] == pytest.approx(sum(g["cost_usd"] for g in answer["data"]))
    grouped_csv = csv_rows(usage(sqlite_gateway, t["a1"], group_by="model", format="csv").text)
    assert [(r["model"], r["requests"]) for r in grouped_csv] == [(MODEL, "5")]


def test_time_ranges(sqlite_gateway: Gateway, two_tenants: dict[str, Any]) -> None:
    t = two_tenants
    now = datetime.now(UTC)
    assert usage(sqlite_gateway, t["a1"], start=(now - timedelta(hours=1)).isoformat()).json()["total"]["requests"] == 5
    assert usage(sqlite_gateway, t["a1"], end=(now - timedelta(hours=1)).isoformat()).json()["total"]["requests"] == 0
    assert usage(sqlite_gateway, t["a1"], start=str(int(now.timestamp()) + 3600)).json()["data"] == []
    tomorrow = (now + timedelta(days=1)).date().isoformat()
    assert usage(sqlite_gateway, t["a1"], start="2020-01-01", end=tomorrow).json()["total"]["requests"] == 5


def test_csv_by_accept_header_and_as_an_attachment(sqlite_gateway: Gateway, two_tenants: dict[str, Any]) -> None:
    reply = httpx.get(f"{sqlite_gateway.url}/v1/usage", timeout=30,
                      headers={"Authorization": f"Bearer {two_tenants['a2']}", "Accept": "text/csv"})
    assert reply.headers["content-type"].startswith("text/csv")
    assert "attachment" in reply.headers["content-disposition"]
    rows = csv_rows(reply.text)
    assert len(rows) == 5 and rows == sorted(rows, key=lambda r: (r["created_at"], r["request_id"]))
    assert all(r["status"] == "ok" and float(r["ttft_s"]) > 0 and Decimal(r["cost_usd"]) > 0 for r in rows)


@pytest.mark.parametrize(("params", "param", "needle"), [
    ({"start": "yesterday"}, "start", "ISO 8601"),
    ({"end": "2026-13-01"}, "end", "ISO 8601"),
    ({"start": "2026-03-02", "end": "2026-03-01"}, "end", "later than start"),
    ({"group_by": "hour"}, "group_by", "choose from tenant, key, model, day, status"),
    ({"group_by": "key,key"}, "group_by", "twice"),
    ({"format": "xml"}, "format", "json or csv"),
    ({"groupby": "key"}, "groupby", "unknown parameter"),
])
def test_bad_parameters_are_a_400_naming_them(sqlite_gateway: Gateway, two_tenants: dict[str, Any],
                                              params: dict[str, str], param: str, needle: str) -> None:
    reply = usage(sqlite_gateway, two_tenants["a1"], **params)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and needle in error["message"]


@pytest.mark.slow  # runs `crescent usage`, a process
def test_crescent_usage_reads_the_database(sqlite_url: str, two_tenants: dict[str, Any]) -> None:
    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "crescent.services.cli", "usage", "--database-url", sqlite_url,
                               *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    grouped = csv_rows(cli("--tenant", "api-a", "--group-by", "key", "--csv"))
    assert sorted(int(r["requests"]) for r in grouped) == [2, 3]
    rows = csv_rows(cli("--tenant", "api-b", "--csv"))
    assert len(rows) == 4 and {r["tenant_id"] for r in rows} == {two_tenants["b"]}
    table = cli("--tenant", "api-a")  # not a terminal: tab-separated lines
    assert table.splitlines()[0].split("\t")[:2] == ["requests", "prompt_tokens"]
    assert table.splitlines()[1].split("\t")[0] == "5"
