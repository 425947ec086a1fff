"""Rate limits and spend budgets per API key and per tenant: what a request may take, and its bill.

A request is held to its key's limits and its tenant's (each: the row set with ``crescent keys
limits`` or the admin API, else the gateway's ``limits.key`` / ``limits.tenant`` defaults):
requests per minute, weighted tokens per minute, requests in flight, dollars per calendar month.
``RateLimiter.admit`` checks them all in one store call once the prompt is tokenized; tokens are
reserved as the prompt plus every choice's ``max_tokens`` (a reservation larger than a whole
limit takes the whole limit: it waits for a full bucket instead of being refused forever).
``settle``, when the response has been sent, corrects the reservation to the tokens actually
used, frees the slot and charges the cost. docs/limits.md has the rules for clients.

A refusal is a 429 that names the limit, whose it is and when to retry (``RateLimitExceeded``);
a spent budget is ``insufficient_quota``. Either is told apart from the scheduler's SLO 429
(type ``rate_limit_error``) by its type. When the store cannot be reached the limiter fails
open or closed (``limits.on_store_error``) and says so in the log, at most every 10 s.

The ledger is the truth of what was spent: a budget's counter is raised to the month's sum in the
usage ledger (``spent``) when the limiter first meets the budget and every ``_BUDGET_SYNC_S``
after, so a restarted gateway (in-process counters) or a restarted Redis does not hand a tenant
a fresh budget.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from urllib.parse import urlsplit

from prometheus_client import Counter

from crescent.services.gateway.accounting import UsageCounts
from crescent.services.gateway.auth import Principal
from crescent.services.gateway.errors import RateLimitedError, ServiceUnavailableError
from crescent.services.gateway.limits.settings import LimitSettings, LimitValues
from crescent.services.gateway.limits.store import (
    BudgetCheck,
    Checks,
    LimitStore,
    LimitStoreError,
    MemoryLimitStore,
    RateCheck,
    RateState,
    Settlement,
    SlotCheck,
)
from crescent.services.tenancy.limits import LimitBook, Limits, to_nano
from crescent.services.tenancy.pricing import PriceTable

log = logging.getLogger(__name__)

_CACHE_ENTRIES = 10_000
_LOG_EVERY_S = 10.0
_BUDGET_KEEP_S = 86_400.0  # a month's spend counter outlives the month by a day
_BUDGET_SYNC_S = 60.0  # how often a budget counter is raised to the ledger's sum again
_PING_EVERY_S = 2.0  # /health asks a required store at most this often

# (tenant id, key id or None for the whole tenant, since) -> nano-dollars spent (UsageStore.spent_nusd)
SpendSource = Callable[[str, str | None, datetime], int]


@cache
def limit_metrics() -> tuple[Counter, Counter]:
    """(refusals by limit and scope, store failures): registered once per process."""
    return (Counter("crescent_gateway_rate_limited", "Requests refused by a key's or tenant's limit",
                    ["limit", "scope"]),
            Counter("crescent_gateway_limit_store_errors", "Calls to the rate-limit store that failed"))


class RateLimitExceeded(RateLimitedError):
    """A key's or tenant's own limit refused the request (OpenAI's shape: type ``requests`` or
    ``tokens``, code ``rate_limit_exceeded``; ``insufficient_quota`` for a spent budget)."""

    def __init__(self, message: str, *, type_: str, code: str, retry_after_s: float,
                 headers: dict[str, str]) -> None:
        super().__init__(message, retry_after_s=retry_after_s, code=code)
        self.type = type_
        self.limit_headers = headers  # x-ratelimit-*

    def headers(self) -> dict[str, str]:
        return self.limit_headers | super().headers()


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it: ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    return f"{minutes}m{secs}" if minutes else secs


def month_left(now: datetime) -> tuple[str, float]:
    """(this UTC month as ``YYYYMM``, seconds until the next one begins)."""
    following = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
    return f"{now.year:04d}{now.month:02d}", (following - now).total_seconds()


@dataclass(frozen=True, slots=True)
class _Scope:
    kind: str    # "key" or "tenant"
    id: str
    tenant_id: str
    limits: Limits

    @property
    def label(self) -> str:
        return f"{self.kind} {self.id}"


@dataclass(frozen=True, slots=True)
class _Rule:
    """One counter a request is checked against, and what to tell a client it refuses."""

    scope: _Scope
    name: str    # "requests", "tokens", "concurrent", "budget"
    limit: int


@dataclass(slots=True)
class Ticket:
    """An admitted request: what it reserved, to be settled once when it ends."""

    model: str
    lease_id: str
    tokens: list[tuple[str, int, int]]   # (rate key, limit, units reserved)
    slots: list[str]
    budgets: list[str]
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False


class RateLimiter:
    """Checks requests against their key's and tenant's limits in a ``LimitStore``.

    ``start`` runs the task that renews the concurrency leases of running requests; ``close``
    stops it and closes the store. Limits read from the database are reused for ``cache_s``.
    """

    def __init__(self, settings: LimitSettings, store: LimitStore, book: LimitBook | None, prices: PriceTable,
                 *, cache_s: float = 5.0, wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 spent: SpendSource | None = None) -> None:
        self._settings = settings
        self._spent = spent
        self._synced: dict[str, float] = {}  # budget key -> when it was last raised to the ledger's sum
        self.store = store
        self._book = book
        self._prices = prices
        self._cache_s = cache_s
        self._wall_clock = wall_clock
        self._key_default = _limits(settings.key)
        self._tenant_default = _limits(settings.tenant)
        self._cached: OrderedDict[tuple[str, str | None], tuple[float, tuple[_Scope, ...]]] = OrderedDict()
        self._leases: dict[str, list[tuple[str, str]]] = {}  # lease id -> (slot key, lease id)
        self._renewing: asyncio.Task[None] | None = None
        self._settling: set[asyncio.Task[None]] = set()
        self._failing_since: float | None = None
        self._failures = 0
        self._logged_at = 0.0
        self._refused, self._store_errors = limit_metrics()
        self._pinged: tuple[float, str | None] = (-_PING_EVERY_S, None)  # (when, what was wrong)

    @classmethod
    def open(cls, settings: LimitSettings, book: LimitBook | None, prices: PriceTable, *,
             cache_s: float = 5.0, spent: SpendSource | None = None) -> RateLimiter:
        if settings.store == "memory":
            store: LimitStore = MemoryLimitStore(settings.period_s, settings.lease_s)
            log.info("rate limits: counters in this process (one gateway; limits.store)")
        else:
            from crescent.services.gateway.limits.redis_store import RedisLimitStore  # only deployments with Redis need it

            store = RedisLimitStore(settings.store, settings.period_s, settings.lease_s, settings.store_timeout_s)
            parts = urlsplit(settings.store)
            log.info("rate limits: counters in Redis at %s (shared by every gateway on it; on_store_error=%s)",
                     parts.hostname or parts.path, settings.on_store_error)
        limiter = cls(settings, store, book, prices, cache_s=cache_s, spent=spent)
        if hasattr(store, "on_background_error"):  # admissions answered after the request went on
            store.on_background_error = limiter._store_failed
        return limiter

    def start(self) -> None:
        self._renewing = asyncio.get_running_loop().create_task(self._renew_leases())

    async def close(self) -> None:
        if self._renewing is not None:
            self._renewing.cancel()
            await asyncio.gather(self._renewing, return_exceptions=True)
        await asyncio.gather(*self._settling, return_exceptions=True)
        await self.store.close()

    async def required_store_problem(self) -> str | None:
        """Why requests cannot be served now because of the store (``on_store_error: closed`` and
        it does not answer), asked at most every ``_PING_EVERY_S``; None otherwise."""
        if self._settings.on_store_error != "closed":
            return None
        now = time.monotonic()
        if now - self._pinged[0] >= _PING_EVERY_S:
            try:
                await self.store.ping()
                problem = None
            except LimitStoreError as exc:
                self._store_failed(exc)
                problem = f"rate-limit store unreachable ({exc})"
            self._pinged = (now, problem)
        return self._pinged[1]

    def forget(self, subject_id: str) -> None:
        """Drop cached limits involving ``subject_id`` (a key or tenant whose limits just changed here)."""
        for entry in [e for e in self._cached if subject_id in e]:
            del self._cached[entry]

    # ---- the request path ------------------------------------------------------------------

    async def admit(self, principal: Principal, model: str, prompt_tokens: int,
                    max_completion_tokens: int) -> Ticket | None:
        """Take what the request needs, or raise the 429 of the limit it is over (None: no limits apply)."""
        scopes = await self._scopes(principal)
        if not scopes:
            return None
        weights = self._settings.token_weights
        estimate = math.ceil(max(weights.prompt, weights.cached) * prompt_tokens
                             + weights.completion * max_completion_tokens)
        month, month_left_s = month_left(self._wall_clock())
        rules: list[_Rule] = []
        rates, slots, budgets = [], [], []
        ticket = Ticket(model, uuid.uuid4().hex, [], [], [])
        for scope in scopes:
            limits = scope.limits
            if limits.rpm is not None:
                rates.append(RateCheck(self._key(scope, "rpm"), limits.rpm, 1))
                rules.append(_Rule(scope, "requests", limits.rpm))
            if limits.tpm is not None:
                reserved = min(estimate, limits.tpm)
                rates.append(RateCheck(self._key(scope, "tpm"), limits.tpm, reserved))
                rules.append(_Rule(scope, "tokens", limits.tpm))
                ticket.tokens.append((rates[-1].key, limits.tpm, reserved))
        for scope in scopes:
            if scope.limits.max_concurrent is not None:
                slots.append(SlotCheck(self._key(scope, "concurrent"), scope.limits.max_concurrent))
                rules.append(_Rule(scope, "concurrent", scope.limits.max_concurrent))
                ticket.slots.append(slots[-1].key)
        for scope in scopes:
            if scope.limits.budget_usd is not None:
                budgets.append(BudgetCheck(self._key(scope, f"spend:{month}"), to_nano(scope.limits.budget_usd),
                                           month_left_s))
                await self._sync_budget(scope, budgets[-1].key, month_left_s)
                rules.append(_Rule(scope, "budget", budgets[-1].limit))
                ticket.budgets.append(budgets[-1].key)
        try:
            verdict = await self.store.admit(Checks(tuple(rates), tuple(slots), tuple(budgets), ticket.lease_id))
        except LimitStoreError as exc:
            self._store_failed(exc)
            if self._settings.on_store_error == "closed":
                raise ServiceUnavailableError("the rate-limit store is unavailable; retry later",
                                              retry_after_s=1.0, code="rate_limit_store_unavailable") from None
            return None
        self._store_ok()
        headers = _headers(rules, verdict.rates)
        if verdict.refused is not None:
            rule = rules[verdict.refused]
            self._refused.labels(limit=rule.name, scope=rule.scope.kind).inc()
            raise _refusal(rule, verdict.retry_after_s, estimate, headers)
        ticket.headers = headers
        if ticket.slots:
            self._leases[ticket.lease_id] = [(key, ticket.lease_id) for key in ticket.slots]
        return ticket

    async def settle(self, ticket: Ticket, usage: UsageCounts | None) -> None:
        """The end of an admitted request: tokens corrected to ``usage``, slot freed, cost charged."""
        if ticket.settled:
            return
        ticket.settled = True
        self._leases.pop(ticket.lease_id, None)
        usage = usage or UsageCounts(0, 0, 0)
        weights = self._settings.token_weights
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        actual = math.ceil(weights.prompt * (usage.prompt_tokens - cached) + weights.cached * cached
                           + weights.completion * usage.completion_tokens)
        cost = to_nano(self._prices.for_model(ticket.model).price(usage.prompt_tokens, cached, usage.completion_tokens))
        keep_s = month_left(self._wall_clock())[1] + _BUDGET_KEEP_S
        settlement = Settlement(
            rates=tuple((key, limit, actual - reserved) for key, limit, reserved in ticket.tokens),
            slots=tuple(ticket.slots),
            budgets=tuple((key, cost, keep_s) for key in ticket.budgets) if cost > 0 else (),
            lease_id=ticket.lease_id,
        )
        try:
            outcome = await self.store.send_settle(settlement)  # on its way: the answer is not waited for
        except LimitStoreError as exc:  # the slot frees itself when its lease runs out
            self._store_failed(exc)
            return
        task = asyncio.ensure_future(self._settled(outcome))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settled(self, outcome: Awaitable[None]) -> None:
        try:
            await outcome
        except LimitStoreError as exc:
            self._store_failed(exc)

    def settle_later(self, ticket: Ticket, usage: UsageCounts | None) -> None:
        """``settle`` in a task of the limiter's (for a request being cancelled); ``close`` waits for it."""
        task = asyncio.get_running_loop().create_task(self.settle(ticket, usage))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def headers_for(self, principal: Principal) -> dict[str, str]:
        """The rate-limit headers of a response that took nothing (``GET /v1/models``, a 400, …)."""
        scopes = await self._scopes(principal)
        rules = [_Rule(s, name, limit) for s in scopes
                 for name, limit in (("requests", s.limits.rpm), ("tokens", s.limits.tpm)) if limit is not None]
        if not rules:
            return {}
        checks = [RateCheck(self._key(r.scope, "rpm" if r.name == "requests" else "tpm"), r.limit, 0) for r in rules]
        try:
            states = await self.store.peek(checks)
        except LimitStoreError as exc:
            self._store_failed(exc)
            return {}
        return _headers(rules, states)

    # ---- internals ---------------------------------------------------------------------------

    async def _sync_budget(self, scope: _Scope, key: str, month_left_s: float) -> None:
        """Raise the budget counter ``key`` to what the ledger counts this month (see the module
        doc): before the first admission under it, in the background after that."""
        now = time.monotonic()
        last = self._synced.get(key)
        if self._spent is None or (last is not None and now - last < _BUDGET_SYNC_S):
            return
        self._synced[key] = now
        if last is None:
            await self._raise_to_ledger(scope, key, month_left_s)
        else:
            task = asyncio.get_running_loop().create_task(self._raise_to_ledger(scope, key, month_left_s))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _raise_to_ledger(self, scope: _Scope, key: str, month_left_s: float) -> None:
        assert self._spent is not None
        wall = self._wall_clock()
        month_start = datetime(wall.year, wall.month, 1, tzinfo=UTC)
        try:
            spent = await asyncio.to_thread(self._spent, scope.tenant_id, scope.id if scope.kind == "key" else None,
                                            month_start)
            if spent:
                await self.store.seed_budget(key, spent, month_left_s + _BUDGET_KEEP_S)
        except LimitStoreError as exc:
            self._store_failed(exc)
        except Exception:  # noqa: BLE001 - the database is away: the counter as it is, tried again later
            log.exception("reading this month's spend of %s %s from the usage ledger failed", scope.kind, scope.id)

    def _key(self, scope: _Scope, counter: str) -> str:
        # Every key of a request carries its tenant as the hash tag: one Redis Cluster slot.
        return f"{self._settings.key_prefix}{{{scope.tenant_id}}}:{counter}:{scope.id}"

    async def _scopes(self, principal: Principal) -> tuple[_Scope, ...]:
        """The key's and the tenant's limits (those with any limit at all), cached for ``cache_s``."""
        entry = (principal.tenant_id, principal.key_id)
        now = time.monotonic()
        cached = self._cached.get(entry)
        if cached is not None and now - cached[0] < self._cache_s:
            return cached[1]
        if self._book is not None:
            key_row, tenant_row = await asyncio.to_thread(self._book.for_request, principal.tenant_id, principal.key_id)
        else:
            key_row, tenant_row = Limits(), Limits()
        scopes = []
        if principal.key_id is not None:
            scopes.append(_Scope("key", principal.key_id, principal.tenant_id, key_row.over(self._key_default)))
        scopes.append(_Scope("tenant", principal.tenant_id, principal.tenant_id, tenant_row.over(self._tenant_default)))
        found = tuple(s for s in scopes if s.limits.any)
        self._cached[entry] = (now, found)
        self._cached.move_to_end(entry)
        while len(self._cached) > _CACHE_ENTRIES:
            self._cached.popitem(last=False)
        return found

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(self._settings.lease_s / 3)
            leases = [lease for held in self._leases.values() for lease in held]
            try:
                await self.store.renew(leases)
            except LimitStoreError as exc:
                self._store_failed(exc)

    def _store_failed(self, exc: LimitStoreError) -> None:
        self._store_errors.inc()
        self._failures += 1
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if now - self._logged_at >= _LOG_EVERY_S:
            self._logged_at = now
            mode = ("requests are served WITHOUT rate limits or budgets" if self._settings.on_store_error == "open"
                    else "requests are refused with 503")
            log.error("the rate-limit store is unreachable (%s; %d failed calls in %.0f s): %s "
                      "(limits.on_store_error=%s)", exc, self._failures, now - self._failing_since, mode,
                      self._settings.on_store_error)

    def _store_ok(self) -> None:
        if self._failing_since is not None:
            log.warning("the rate-limit store answers again after %.0f s (%d failed calls)",
                        time.monotonic() - self._failing_since, self._failures)
            self._failing_since, self._failures, self._logged_at = None, 0, 0.0


def _limits(values: LimitValues) -> Limits:
    return Limits(values.rpm, values.tpm, values.max_concurrent, values.budget_usd)


def _headers(rules: list[_Rule], states: tuple[RateState, ...]) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers: of the key's and tenant's rates, the one with less left."""
    headers: dict[str, str] = {}
    rated = [(rule, state) for rule, state in zip(rules, states)]  # rates come first in ``rules``
    for name in ("requests", "tokens"):
        mine = [(state.remaining, rule.limit, state.reset_s) for rule, state in rated if rule.name == name]
        if mine:
            remaining, limit, reset_s = min(mine)
            headers |= {f"x-ratelimit-limit-{name}": str(limit), f"x-ratelimit-remaining-{name}": str(remaining),
                        f"x-ratelimit-reset-{name}": format_reset(reset_s)}
    return headers


def _refusal(rule: _Rule, retry_after_s: float, estimate: int, headers: dict[str, str]) -> RateLimitExceeded:
    wait = format_reset(retry_after_s)
    who = rule.scope.label
    if rule.name == "requests":
        message = f"Rate limit reached for {who} on requests per minute (RPM): Limit {rule.limit}."
        type_, code = "requests", "rate_limit_exceeded"
    elif rule.name == "tokens":
        message = (f"Rate limit reached for {who} on tokens per minute (TPM): Limit {rule.limit}, Requested "
                   f"{estimate} (the prompt plus max_tokens for every choice; a smaller max_tokens reserves less).")
        type_, code = "tokens", "rate_limit_exceeded"
    elif rule.name == "concurrent":
        message = f"Concurrency limit reached for {who}: Limit {rule.limit} requests in flight."
        type_, code = "concurrent_requests", "rate_limit_exceeded"
    else:
        limit_usd = rule.scope.limits.budget_usd
        return RateLimitExceeded(
            f"You exceeded the monthly budget of {who} (${limit_usd}); requests resume when the month ends "
            f"(UTC) or when the budget is raised.", type_="insufficient_quota", code="insufficient_quota",
            retry_after_s=retry_after_s, headers=headers)
    return RateLimitExceeded(f"{message} Please try again in {wait}.", type_=type_, code=code,
                             retry_after_s=retry_after_s, headers=headers)
