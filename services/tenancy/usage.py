"""The usage ledger in the gateway's database: one row per request, written once, read by range.

A row is written with its request id as the primary key and ``ON CONFLICT DO NOTHING`` (SQLite
and PostgreSQL alike), so writing the same row again — a batch retried after a commit whose
answer was lost — never counts a request twice. Money is kept in whole nano-dollars
(``cost_nusd``): integer sums are exact, and a price with up to three decimals per million
tokens is exact per token.

Reads are totals over ``[start, end)`` grouped by any of ``GROUPS`` (``day`` is the UTC date),
or the rows themselves in (created_at, request_id) order, a page at a time.
``UsageStore`` methods block (database calls): the gateway runs them in a worker thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from sqlalchemy import Engine, String, and_, cast, func, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql import ColumnElement

from crescent.services.tenancy.schema import usage

NANO = Decimal("1e-9")
GROUPS = ("tenant", "key", "model", "day", "status")  # what totals can be grouped by
_COLUMNS = {"tenant": usage.c.tenant_id, "key": usage.c.api_key_id, "model": usage.c.model, "status": usage.c.status}


def to_nano(usd: Decimal) -> int:
    """US dollars as whole nano-dollars (half-even rounding below a nano-dollar)."""
    return int((usd / NANO).quantize(Decimal(1), rounding=ROUND_HALF_EVEN))


def from_nano(nusd: int) -> Decimal:
    return Decimal(nusd) * NANO


def utc(moment: datetime) -> datetime:
    """``moment`` in UTC (a naive one, as SQLite gives back, is taken as UTC already)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


class _Priced:
    """Cost and savings in dollars, from the exact nano-dollar fields of the class."""

    __slots__ = ()
    cost_nusd: int
    savings_nusd: int

    @property
    def cost_usd(self) -> Decimal:
        return from_nano(self.cost_nusd)

    @property
    def savings_usd(self) -> Decimal:
        return from_nano(self.savings_nusd)


@dataclass(frozen=True, slots=True)
class UsageRow(_Priced):
    """One request in the ledger."""

    request_id: str
    created_at: datetime
    tenant_id: str
    api_key_id: str | None
    model: str
    status: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    ttft_s: float | None
    cost_nusd: int
    savings_nusd: int


@dataclass(frozen=True, slots=True)
class UsageTotals(_Priced):
    """Sums over the requests of one group (``group`` maps each grouping to its value)."""

    group: dict[str, str | None]
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cost_nusd: int
    savings_nusd: int


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """Which requests: arrived in ``[start, end)`` (None: unbounded), of ``tenant_id`` (None: all)."""

    start: datetime | None = None
    end: datetime | None = None
    tenant_id: str | None = None

    def where(self) -> list[ColumnElement[bool]]:
        clauses: list[ColumnElement[bool]] = []
        if self.start is not None:
            clauses.append(usage.c.created_at >= utc(self.start))
        if self.end is not None:
            clauses.append(usage.c.created_at < utc(self.end))
        if self.tenant_id is not None:
            clauses.append(usage.c.tenant_id == self.tenant_id)
        return clauses


class UsageStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def insert(self, rows: Sequence[UsageRow]) -> None:
        """Write ``rows`` in one transaction; a request already in the ledger is left as it is."""
        if not rows:
            return
        dialect = self.engine.dialect.name
        if dialect == "postgresql":
            statement = postgresql.insert(usage).on_conflict_do_nothing(index_elements=["request_id"])
        elif dialect == "sqlite":
            statement = sqlite.insert(usage).on_conflict_do_nothing(index_elements=["request_id"])
        else:
            raise NotImplementedError(f"the usage ledger supports SQLite and PostgreSQL, not {dialect}")
        with self.engine.begin() as db:
            db.execute(statement, [asdict(row) | {"created_at": utc(row.created_at)} for row in rows])

    def spent_nusd(self, tenant_id: str, api_key_id: str | None, since: datetime) -> int:
        """Nano-dollars the tenant (or, with ``api_key_id``, that key) spent since ``since``."""
        clauses = [usage.c.tenant_id == tenant_id, usage.c.created_at >= utc(since)]
        if api_key_id is not None:
            clauses.append(usage.c.api_key_id == api_key_id)
        with self.engine.connect() as db:
            return int(db.execute(select(func.coalesce(func.sum(usage.c.cost_nusd), 0)).where(*clauses)).scalar_one())

    def _day(self) -> ColumnElement[str]:
        if self.engine.dialect.name == "postgresql":
            return func.to_char(func.timezone("UTC", usage.c.created_at), "YYYY-MM-DD")
        return func.substr(cast(usage.c.created_at, String), 1, 10)  # stored as 'YYYY-MM-DD HH:MM:SS…' (UTC)

    def totals(self, query: UsageQuery, group_by: Sequence[str] = ()) -> list[UsageTotals]:
        """Sums per group (one group of everything without ``group_by``), groups in order."""
        unknown = [g for g in group_by if g not in GROUPS]
        if unknown:
            raise ValueError(f"cannot group usage by {unknown[0]!r}; choose from {', '.join(GROUPS)}")
        keys = [(g, self._day() if g == "day" else _COLUMNS[g]) for g in group_by]
        sums = [
            func.count().label("requests"),
            *(func.coalesce(func.sum(getattr(usage.c, name)), 0).label(name)
              for name in ("prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens",
                           "cost_nusd", "savings_nusd")),
        ]
        statement = select(*(column.label(f"g_{g}") for g, column in keys), *sums).where(*query.where())
        if keys:
            statement = statement.group_by(*(c for _, c in keys)).order_by(*(c for _, c in keys))
        with self.engine.connect() as db:
            found = db.execute(statement).all()
        return [
            UsageTotals(
                group={g: getattr(r, f"g_{g}") for g, _ in keys},
                requests=int(r.requests), prompt_tokens=int(r.prompt_tokens), cached_tokens=int(r.cached_tokens),
                completion_tokens=int(r.completion_tokens), reasoning_tokens=int(r.reasoning_tokens),
                cost_nusd=int(r.cost_nusd), savings_nusd=int(r.savings_nusd),
            )
            for r in found
            if keys or r.requests  # no group_by and no rows: no totals row (callers show zeros)
        ]

    def rows(self, query: UsageQuery, *, after: tuple[datetime, str] | None = None, limit: int = 1000) -> list[UsageRow]:
        """Up to ``limit`` rows in (created_at, request_id) order, after the row ``after`` names."""
        statement = select(usage).where(*query.where())
        if after is not None:
            moment, request_id = utc(after[0]), after[1]
            statement = statement.where(or_(usage.c.created_at > moment,
                                            and_(usage.c.created_at == moment, usage.c.request_id > request_id)))
        statement = statement.order_by(usage.c.created_at, usage.c.request_id).limit(limit)
        with self.engine.connect() as db:
            return [_row(r._mapping) for r in db.execute(statement)]

    def all_rows(self, query: UsageQuery, page: int = 1000) -> Iterator[UsageRow]:
        """Every row of ``query``, read a page at a time."""
        after = None
        while True:
            found = self.rows(query, after=after, limit=page)
            yield from found
            if len(found) < page:
                return
            after = (found[-1].created_at, found[-1].request_id)


def _row(mapping: Any) -> UsageRow:  # noqa: ANN401 - a SQLAlchemy row mapping
    values = dict(mapping)
    values["created_at"] = utc(values["created_at"])
    return UsageRow(**values)
