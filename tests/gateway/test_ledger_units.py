"""The usage ledger's writer and pricing without a network: group commit, retries while the
database is away, prices and savings, reasoning tokens counted from the output parser."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from decimal import Decimal
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from crescent.services.common.metrics import UsageMetrics, gateway_metrics
from crescent.services.gateway.accounting import RequestRecord, UsageCounts, response_usage
from crescent.services.gateway.parsing.assistant_output import ReasoningDelta, parse_output
from crescent.services.gateway.auth import Principal
from crescent.services.gateway.config import LedgerSettings
from crescent.services.gateway.generation import Finished, GenerationEvent, TextDelta
from crescent.services.gateway.ledger import UsageLedger
from crescent.services.gateway.parsing.output_format import OutputFormat
from crescent.services.gateway.parsing.reasoning import THINK_TAGS
from crescent.services.tenancy import KeyStore, connect_database
from crescent.services.tenancy.pricing import ModelPrices, PriceTable
from crescent.services.tenancy.usage import UsageQuery, UsageRow, UsageStore

TENANT = Principal("default", None, b"salt")


def fresh_metrics() -> UsageMetrics:
    registry = CollectorRegistry()  # each test counts from zero
    spender = ["tenant", "model"]
    return UsageMetrics(
        spend_usd=Counter("spend_usd", "", spender, registry=registry),
        cache_savings_usd=Counter("cache_savings_usd", "", spender, registry=registry),
        ledger_pending=Gauge("pending", "", registry=registry),
        ledger_commit=Histogram("commit_seconds", "", registry=registry),
        ledger_wait=Histogram("wait_seconds", "", registry=registry),
        ledger_errors=Counter("errors", "", registry=registry),
        refused=Counter("refused", "", [*spender, "status"], registry=registry),
    )


class CountingStore(UsageStore):
    """A real SQLite store that counts its commits and can be made to fail."""

    def __init__(self, path: Path) -> None:
        engine = connect_database(f"sqlite:///{path}")
        KeyStore(engine).ensure_tenant("default")
        super().__init__(engine)
        self.batches: list[int] = []
        self.failing = 0

    def insert(self, rows: list[UsageRow]) -> None:  # type: ignore[override]
        if self.failing:
            self.failing -= 1
            raise ConnectionError("database away")
        super().insert(rows)
        self.batches.append(len(rows))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CountingStore]:
    found = CountingStore(tmp_path / "gateway.sqlite3")
    yield found
    found.engine.dispose()


def finish(ledger: UsageLedger, request_id: str, usage: UsageCounts, model: str = "kimi-k3") -> RequestRecord:
    record = RequestRecord(gateway_metrics(), account=ledger.account(request_id, TENANT, model))
    record.set_usage(usage)
    record.finish("ok")
    return record


def test_rows_finished_together_share_a_commit_and_each_waits_for_it(store: CountingStore) -> None:
    async def run() -> None:
        ledger = UsageLedger(store, PriceTable(), LedgerSettings(), fresh_metrics())
        ledger.start()
        records = [finish(ledger, f"r{i}", UsageCounts(100, 40, 10)) for i in range(300)]
        await asyncio.gather(*(r.committed() for r in records))
        assert ledger.pending == 0
        await ledger.close()

    asyncio.run(run())
    assert sum(store.batches) == 300 and len(store.batches) <= 2  # group commit, not 300 transactions
    [total] = store.totals(UsageQuery())
    assert (total.requests, total.prompt_tokens, total.cached_tokens, total.completion_tokens) == (300, 30000, 12000, 3000)


def test_a_database_outage_delays_rows_without_losing_them(store: CountingStore) -> None:
    store.failing = 2
    metrics = fresh_metrics()

    async def run() -> None:
        ledger = UsageLedger(store, PriceTable(), LedgerSettings(), metrics)
        ledger.start()
        record = finish(ledger, "during-outage", UsageCounts(10, 0, 1))
        await asyncio.wait_for(record.committed(), timeout=5)
        await ledger.close()

    asyncio.run(run())
    assert metrics.ledger_errors._value.get() == 2  # noqa: SLF001 - prometheus_client's value
    assert [r.request_id for r in store.all_rows(UsageQuery())] == ["during-outage"]


def test_a_response_waits_at_most_commit_wait_s(store: CountingStore) -> None:
    store.failing = 10**6  # the database never comes back

    async def run() -> float:
        ledger = UsageLedger(store, PriceTable(), LedgerSettings(commit_wait_s=0.2), fresh_metrics())
        ledger.start()
        record = finish(ledger, "stuck", UsageCounts(10, 0, 1))
        loop = asyncio.get_running_loop()
        started = loop.time()
        await record.committed()
        waited = loop.time() - started
        assert ledger.pending == 1  # still queued, retried
        await ledger.close()  # gives up after its own bound, logging what is lost
        return waited

    import crescent.services.gateway.ledger as ledger_module

    ledger_module._CLOSE_WAIT_S = 0.3  # noqa: SLF001 - keep the test short
    try:
        assert 0.15 < asyncio.run(run()) < 1.0
    finally:
        ledger_module._CLOSE_WAIT_S = 10.0  # noqa: SLF001


def test_without_durability_responses_do_not_wait(store: CountingStore) -> None:
    async def run() -> None:
        ledger = UsageLedger(store, PriceTable(), LedgerSettings(durable=False), fresh_metrics())
        ledger.start()
        record = finish(ledger, "fast", UsageCounts(10, 0, 1))
        await record.committed()
        assert ledger.pending == 1  # answered before the commit
        await ledger.close()  # still written at shutdown

    asyncio.run(run())
    assert [r.request_id for r in store.all_rows(UsageQuery())] == ["fast"]


def test_prices_come_from_the_table_and_feed_the_spend_metrics(store: CountingStore) -> None:
    metrics = fresh_metrics()
    table = PriceTable(models={"*": ModelPrices(), "small": ModelPrices(cache_hit_input=Decimal("0.01"),
                                                                         cache_miss_input=Decimal("0.10"),
                                                                         output=Decimal("0.40"))})

    async def run() -> None:
        ledger = UsageLedger(store, table, LedgerSettings(), metrics)
        ledger.start()
        await finish(ledger, "k3", UsageCounts(1_000_000, 900_000, 100_000)).committed()
        await finish(ledger, "small", UsageCounts(1_000_000, 0, 1_000_000), model="small").committed()
        await ledger.close()

    asyncio.run(run())
    rows = {r.request_id: r for r in store.all_rows(UsageQuery())}
    # K3: 900k hits at $0.30 + 100k misses at $3.00 + 100k output at $15.00 = $0.27 + $0.30 + $1.50.
    assert rows["k3"].cost_usd == Decimal("2.07") and rows["k3"].savings_usd == Decimal("2.43")
    assert rows["small"].cost_usd == Decimal("0.50") and rows["small"].savings_usd == 0
    spend = metrics.spend_usd.labels(tenant="default", model="kimi-k3")._value.get()  # noqa: SLF001
    assert spend == pytest.approx(2.07)


def test_disabled_ledger_prices_requests_but_writes_nothing() -> None:
    metrics = fresh_metrics()

    async def run() -> None:
        ledger = UsageLedger(None, PriceTable(), LedgerSettings(enabled=False), metrics)
        ledger.start()
        await finish(ledger, "r", UsageCounts(1_000_000, 0, 0)).committed()
        await ledger.close()

    asyncio.run(run())
    assert metrics.spend_usd.labels(tenant="default", model="kimi-k3")._value.get() == pytest.approx(3.0)  # noqa: SLF001


async def _tokens(pieces: list[str], record: RequestRecord) -> AsyncGenerator[GenerationEvent, None]:
    """What ``generate_text`` does for the record: count each token, then yield its text."""
    for count, text in enumerate(pieces, start=1):
        record.set_usage(UsageCounts(5, 0, count))
        yield TextDelta(text)
    yield Finished("stop", record.set_usage(UsageCounts(5, 0, len(pieces))))


@pytest.mark.parametrize(("pieces", "reasoning"), [
    (["<think>", "a", "b", "</think>", "answer", "."], 4),   # the closing tag's token is reasoning
    (["<th", "ink>x", "y</thi", "nk>z", "w"], 4),             # tags split across tokens
    (["plain", " answer"], 0),
    (["<think>", "cut", " short"], 3),                        # never closed: all reasoning
])
def test_reasoning_tokens_are_those_generated_until_the_reasoning_ends(pieces: list[str], reasoning: int) -> None:
    async def run() -> int:
        record = RequestRecord(gateway_metrics())
        events = parse_output(_tokens(pieces, record), OutputFormat(reasoning=THINK_TAGS),
                              on_reasoning=record.mark_reasoning)
        seen = [event async for event in events]
        assert any(isinstance(e, ReasoningDelta) for e in seen) == (reasoning > 0)
        [finished] = [e for e in seen if isinstance(e, Finished)]
        assert finished.usage.reasoning_tokens == reasoning  # what the client is told
        record.finish("ok")
        assert record.usage is not None and record.usage.reasoning_tokens == reasoning
        return record.reasoning_tokens

    assert asyncio.run(run()) == reasoning


def test_reasoning_tokens_add_up_over_choices_and_prompts() -> None:
    # Two prompts with two choices each: the prompt counts once per prompt, reasoning per choice.
    usages = [UsageCounts(10, 4, 7, 3), UsageCounts(10, 0, 5, 5), UsageCounts(6, 0, 2, 0), UsageCounts(6, 0, 4, 1)]
    assert response_usage(usages, 2) == UsageCounts(16, 4, 18, 9)
