"""The usage ledger's table on SQLite and on a real PostgreSQL server: idempotent writes, exact
money sums, ranges, grouping and paging."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import Engine

from crescent.services.tenancy import KeyStore, connect_database
from crescent.services.tenancy.pricing import ModelPrices
from crescent.services.tenancy.usage import UsageQuery, UsageRow, UsageStore, from_nano, to_nano

from .postgres import postgres_server

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)

T0 = datetime(2026, 3, 1, 23, 59, 0, tzinfo=UTC)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    if request.param == "sqlite":
        found = connect_database(f"sqlite:///{tmp_path_factory.mktemp('usage')}/gateway.sqlite3")
        yield found
        found.dispose()
        return
    with postgres_server() as url:
        found = connect_database(url)
        yield found
        found.dispose()


@pytest.fixture
def store(engine: Engine) -> UsageStore:
    from crescent.services.tenancy.schema import usage

    with engine.begin() as db:
        db.execute(usage.delete())
    return UsageStore(engine)


def row(request_id: str, at: datetime, tenant: str, key: str | None = None, *, model: str = "kimi-k3",
        status: str = "ok", prompt: int = 1000, cached: int = 600, completion: int = 200) -> UsageRow:
    prices = ModelPrices()
    return UsageRow(request_id, at, tenant, key, model, status, prompt, cached, completion, completion // 4, 0.05,
                    to_nano(prices.price(prompt, cached, completion)), to_nano(prices.savings(cached)))


@pytest.fixture
def tenants(engine: Engine) -> tuple[str, str, str]:
    keys = KeyStore(engine)
    a = keys.ensure_tenant("usage-a").id
    b = keys.ensure_tenant("usage-b").id
    key = keys.create_key("usage-a", "ci").record.id
    return a, b, key


def test_a_request_written_twice_counts_once(store: UsageStore, tenants: tuple[str, str, str]) -> None:
    a, _, key = tenants
    first = [row(f"chatcmpl-{i}", T0 + timedelta(seconds=i), a, key) for i in range(300)]
    store.insert(first)
    store.insert(first[100:] + [row("chatcmpl-new", T0, a, key)])  # a retried batch, plus one new row
    [total] = store.totals(UsageQuery(tenant_id=a))
    assert total.requests == 301
    assert total.prompt_tokens == 301 * 1000 and total.cached_tokens == 301 * 600
    assert total.completion_tokens == 301 * 200 and total.reasoning_tokens == 301 * 50


def test_money_sums_exactly_at_k3_prices(store: UsageStore, tenants: tuple[str, str, str]) -> None:
    a, _, _ = tenants
    store.insert([row(f"r{i}", T0, a, prompt=1, cached=1, completion=0) for i in range(1000)])
    [total] = store.totals(UsageQuery())
    # 1,000 cache hits at $0.30 per million: $0.0003 exactly; they saved $2.70 per million.
    assert total.cost_usd == Decimal("0.0003") and total.savings_usd == Decimal("0.0027")
    assert from_nano(to_nano(ModelPrices().price(1_000_000, 0, 1_000_000))) == Decimal("18")


def test_ranges_are_half_open_and_days_are_utc(store: UsageStore, tenants: tuple[str, str, str]) -> None:
    a, b, key = tenants
    store.insert([
        row("early", T0 - timedelta(seconds=1), a, key),
        row("start", T0, a, key),                       # 2026-03-01 23:59 UTC
        row("next-day", T0 + timedelta(minutes=2), b),  # 2026-03-02 00:01 UTC
        row("end", T0 + timedelta(hours=1), a),
    ])
    window = UsageQuery(start=T0, end=T0 + timedelta(hours=1))
    assert [r.request_id for r in store.all_rows(window)] == ["start", "next-day"]
    by_day = {t.group["day"]: t.requests for t in store.totals(window, ["day"])}
    assert by_day == {"2026-03-01": 1, "2026-03-02": 1}
    # The same instant given in another time zone selects the same rows.
    tokyo = timezone_plus(9)
    assert [r.request_id for r in store.all_rows(UsageQuery(start=T0.astimezone(tokyo), end=T0.astimezone(tokyo)
                                                            + timedelta(hours=1)))] == ["start", "next-day"]


def timezone_plus(hours: int):  # noqa: ANN201 - a tzinfo
    from datetime import timezone

    return timezone(timedelta(hours=hours))


def test_totals_group_by_tenant_key_model_and_status(store: UsageStore, tenants: tuple[str, str, str]) -> None:
    a, b, key = tenants
    store.insert([
        row("1", T0, a, key), row("2", T0, a, key, model="small"), row("3", T0, a, None, status="cancelled"),
        row("4", T0, b),
    ])
    groups = {(t.group["tenant"], t.group["key"]): t.requests for t in store.totals(UsageQuery(), ["tenant", "key"])}
    assert groups == {(a, key): 2, (a, None): 1, (b, None): 1}
    models = {t.group["model"]: t.requests for t in store.totals(UsageQuery(tenant_id=a), ["model"])}
    assert models == {"kimi-k3": 2, "small": 1}
    statuses = {t.group["status"]: t.requests for t in store.totals(UsageQuery(), ["status"])}
    assert statuses == {"ok": 3, "cancelled": 1}
    assert store.totals(UsageQuery(tenant_id="ten_nobody")) == []
    with pytest.raises(ValueError, match="choose from tenant, key, model, day, status"):
        store.totals(UsageQuery(), ["hour"])


def test_rows_come_back_a_page_at_a_time_in_order(store: UsageStore, tenants: tuple[str, str, str]) -> None:
    a, _, _ = tenants
    written = [row(f"p{i:04d}", T0 + timedelta(seconds=i // 3), a) for i in range(250)]  # ties on created_at
    store.insert(list(reversed(written)))
    read = list(store.all_rows(UsageQuery(), page=7))
    assert [r.request_id for r in read] == [r.request_id for r in written]
    assert read[0] == written[0]

