"""The gateway side of the usage ledger: price each finished request, write its row, never twice.

``RequestRecord.finish`` hands a request's outcome to its ``Account`` (``UsageLedger.account``),
which prices it with the price table (cache-hit input, cache-miss input, output), adds the price
and the cache savings to the spend metrics, and queues its row. One writer task commits the
queue in batches (``UsageStore.insert``: the request id is the primary key, a row already there
is left alone), so a request's own cost on the event loop is a dict and a list append.

Durability (``ledger.durable``, on by default) is group commit: before a response's last bytes
(the usage chunk and ``[DONE]``, ``response.completed``, or a whole JSON body) the handler
awaits ``RequestRecord.committed()``, which returns once the batch holding its row is committed.
Rows that finish while a batch commits go into the next one, so under load a commit carries many
rows and a request waits about one commit. Every response a client received whole is therefore
in the database when the gateway is killed (``kill -9``) right after. Requests cut off earlier
(client gone, error) are queued the same way but not waited for: they appear once, or not at all
if the gateway died before their batch. While the database does not answer, a response waits
``commit_wait_s`` at most and then goes out; its row stays queued and is retried (and is lost if
the gateway dies before the database is back: ``crescent_gateway_ledger_pending_rows`` shows it).

With ``ledger.journal_dir`` the wait is one ``write`` instead of a commit: the row goes to a local
write-ahead journal (``ledger_journal.py``) that a restarted gateway replays, so responses no
longer wait for the database at all, and rows survive a database outage and then a kill.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

from crescent.services.common.metrics import UsageMetrics, usage_metrics
from crescent.services.gateway.accounting import RequestStatus, UsageCounts
from crescent.services.gateway.auth import Principal
from crescent.services.gateway.config import LedgerSettings
from crescent.services.gateway.ledger_journal import Journal, Segment
from crescent.services.tenancy.pricing import PriceTable
from crescent.services.tenancy.usage import UsageRow, UsageStore, to_nano

log = logging.getLogger(__name__)

_RETRY_S = (0.05, 0.2, 1.0, 2.0)  # backoff between failed commits, then every 2 s
_CLOSE_WAIT_S = 10.0
_REFUSED = frozenset({"rejected", "client_error"})  # statuses of requests that were never served


class Account:
    """Who pays for one request and where its row goes; ``settle`` once, then ``committed``."""

    __slots__ = ("_ledger", "_request_id", "_tenant_id", "_key_id", "_model", "_created_at", "_written")

    def __init__(self, ledger: UsageLedger, request_id: str, principal: Principal, model: str) -> None:
        self._ledger = ledger
        self._request_id = request_id
        self._tenant_id = principal.tenant_id
        self._key_id = principal.key_id
        self._model = model
        self._created_at = datetime.now(UTC)
        self._written: asyncio.Future[None] | None = None

    def settle(self, status: RequestStatus, usage: UsageCounts | None, reasoning_tokens: int,
               ttft_s: float | None) -> None:
        """Price the request and queue its row (``RequestRecord.finish`` calls it once). A request
        refused before it used anything (a 429, a 400) costs no row, only a count: a client over
        its limits cannot turn its refusals into database writes."""
        if status in _REFUSED and (usage is None or usage.prompt_tokens + usage.completion_tokens == 0):
            self._ledger.metrics.refused.labels(tenant=self._tenant_id, model=self._model, status=status).inc()
            return
        usage = usage or UsageCounts(0, 0, 0)
        prices = self._ledger.prices.for_model(self._model)
        cost = prices.price(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
        savings = prices.savings(min(usage.cached_tokens, usage.prompt_tokens))
        m = self._ledger.metrics
        m.spend_usd.labels(tenant=self._tenant_id, model=self._model).inc(float(cost))
        m.cache_savings_usd.labels(tenant=self._tenant_id, model=self._model).inc(float(savings))
        row = UsageRow(
            request_id=self._request_id, created_at=self._created_at, tenant_id=self._tenant_id,
            api_key_id=self._key_id, model=self._model, status=status, prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens,
            reasoning_tokens=reasoning_tokens, ttft_s=ttft_s, cost_nusd=to_nano(cost), savings_nusd=to_nano(savings),
        )
        self._written = self._ledger.submit(row)

    async def committed(self) -> None:
        """Return once the row is in the database (at once when the ledger is not durable)."""
        if self._written is not None:
            await self._ledger.wait(self._written, self._request_id)


class UsageLedger:
    """Prices requests (``account``) and commits their rows in the background (``start``/``close``).

    ``store`` None: requests are priced into the metrics only (``ledger.enabled`` off)."""

    def __init__(self, store: UsageStore | None, prices: PriceTable, settings: LedgerSettings,
                 metrics: UsageMetrics | None = None) -> None:
        self.store = store
        self.prices = prices
        self.metrics = metrics or usage_metrics()
        self._settings = settings
        # A row, the future its response waits for (durable, no journal), its journal segment.
        self._queue: list[tuple[UsageRow, asyncio.Future[None] | None, Segment | None]] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._writer: asyncio.Task[None] | None = None
        self._journal: Journal | None = None
        if store is not None and settings.durable and settings.journal_dir:
            self._journal = Journal(settings.journal_dir)
            self._commit_recovered(self._journal.recover())

    def _commit_recovered(self, recovered: list[tuple[UsageRow, Segment]]) -> None:
        """Commit the rows a stopped gateway journaled before this one answers anything (so its
        usage queries include them); queued for the writer if the database does not take them."""
        assert self.store is not None and self._journal is not None
        for start in range(0, len(recovered), self._settings.batch_rows):
            batch = recovered[start: start + self._settings.batch_rows]
            try:
                self.store.insert([row for row, _ in batch])
            except Exception:  # noqa: BLE001 - the database is away: the writer retries them
                log.exception("committing %d journaled usage rows failed; queued", len(recovered) - start)
                self._queue += [(row, None, segment) for row, segment in recovered[start:]]
                self.metrics.ledger_pending.inc(len(recovered) - start)
                return
            for _, segment in batch:
                self._journal.done(segment)

    def account(self, request_id: str, principal: Principal, model: str) -> Account:
        return Account(self, request_id, principal, model)

    def start(self) -> None:
        """Start the writer on the running loop (the owner awaits ``close``)."""
        if self.store is not None and self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_batches(), name="usage-ledger")

    def submit(self, row: UsageRow) -> asyncio.Future[None] | None:
        """Queue ``row``; a future that completes once it is committed when the ledger is durable."""
        if self.store is None:
            return None
        written, segment = None, None
        if self._journal is not None:
            try:
                segment = self._journal.append(row)
            except OSError:  # a full or broken disk: wait for the database instead
                log.exception("usage journal write failed; request %s waits for its commit", row.request_id)
        if segment is None and self._settings.durable:
            written = asyncio.get_running_loop().create_future()
        self._queue.append((row, written, segment))
        self.metrics.ledger_pending.inc()
        self._wake.set()
        return written

    async def wait(self, written: asyncio.Future[None], request_id: str) -> None:
        started = asyncio.get_running_loop().time()
        done, _ = await asyncio.wait({written}, timeout=self._settings.commit_wait_s)
        self.metrics.ledger_wait.observe(asyncio.get_running_loop().time() - started)
        if not done:
            log.error("usage row of %s not committed after %.1f s (database away?); answering anyway, the row "
                      "stays queued", request_id, self._settings.commit_wait_s)

    async def _write_batches(self) -> None:
        assert self.store is not None
        failures = 0
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._queue[: self._settings.batch_rows]
            started = asyncio.get_running_loop().time()
            try:
                await asyncio.to_thread(self.store.insert, [row for row, _, _ in batch])
            except Exception:  # noqa: BLE001 - the database is away or refused: keep the rows, retry
                self.metrics.ledger_errors.inc()
                log.exception("committing %d usage rows failed (attempt %d); retrying", len(batch), failures + 1)
                await asyncio.sleep(_RETRY_S[min(failures, len(_RETRY_S) - 1)])
                failures += 1
                continue
            failures = 0
            self.metrics.ledger_commit.observe(asyncio.get_running_loop().time() - started)
            del self._queue[: len(batch)]
            self.metrics.ledger_pending.dec(len(batch))
            for _, written, segment in batch:
                if written is not None and not written.done():
                    written.set_result(None)
                if segment is not None:
                    assert self._journal is not None
                    self._journal.done(segment)

    @property
    def pending(self) -> int:
        return len(self._queue)

    async def close(self) -> None:
        """Commit what is queued (up to ``_CLOSE_WAIT_S``), then stop the writer."""
        self._closing = True
        self._wake.set()
        if self._writer is not None:
            done, _ = await asyncio.wait({self._writer}, timeout=_CLOSE_WAIT_S)
            if not done:
                log.error("stopping with %d usage rows not committed (database away?)%s", len(self._queue),
                          "; they stay in the journal for the next start" if self._journal else "")
                self._writer.cancel()
                await asyncio.gather(self._writer, return_exceptions=True)
            self._writer = None
        if self._journal is not None:
            self._journal.close()
            self._journal = None
