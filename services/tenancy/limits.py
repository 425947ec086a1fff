"""Rate limits and spend budgets of keys and tenants, as set by an operator.

A key or tenant has at most one row in ``rate_limits`` (created by migration 0003); each of its
four limits is NULL for "the gateway's default" (``limits.key`` / ``limits.tenant`` in the gateway
settings). A request is held to both its key's and its tenant's limits. What the gateway enforces
and how is in docs/limits.md; this module only stores the numbers.

``LimitBook`` methods block (database calls): the gateway runs them in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Literal

from sqlalchemy import BigInteger, Column, DateTime, Engine, Integer, String, Table, insert, select, update

from crescent.services.tenancy.keys import KeyStore, TenancyError
from crescent.services.tenancy.schema import api_keys, metadata

SubjectKind = Literal["key", "tenant"]
LIMIT_NAMES = ("rpm", "tpm", "max_concurrent", "budget_usd")
NANO = Decimal("1e-9")  # money is kept in whole nano-dollars, as in the usage ledger: sums stay exact


def to_nano(usd: Decimal) -> int:
    return int((usd / NANO).to_integral_value())


def from_nano(nusd: int) -> Decimal:
    return (Decimal(nusd) * NANO).normalize()

rate_limits = Table(
    "rate_limits", metadata,
    Column("subject_id", String(64), primary_key=True),     # a key id (key_…) or a tenant id
    Column("subject_kind", String(16), nullable=False),     # "key" or "tenant"
    Column("rpm", Integer, nullable=True),                  # requests per minute
    Column("tpm", Integer, nullable=True),                  # weighted tokens per minute
    Column("max_concurrent", Integer, nullable=True),       # requests in flight at once
    Column("budget_nusd", BigInteger, nullable=True),       # spend per calendar month (UTC), nano-dollars
    Column("updated_at", DateTime(timezone=True), nullable=False),
)


@dataclass(frozen=True, slots=True)
class Limits:
    """The limits of one key or tenant; None: not set (the default applies, or no limit)."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    budget_usd: Decimal | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise TenancyError(f"{name} must be at least 1 (or unset)", code="invalid_limit")
        if self.budget_usd is not None and self.budget_usd < 0:
            raise TenancyError("budget_usd must not be negative (or unset)", code="invalid_limit")

    def over(self, fallback: Limits) -> Limits:
        """These limits, with ``fallback``'s where these are not set."""
        mine = (getattr(self, n) for n in LIMIT_NAMES)
        return Limits(*(m if m is not None else getattr(fallback, n) for m, n in zip(mine, LIMIT_NAMES)))

    @property
    def any(self) -> bool:
        return any(getattr(self, n) is not None for n in LIMIT_NAMES)

    def as_dict(self) -> dict[str, int | str | None]:
        out: dict[str, int | str | None] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["budget_usd"] = None if self.budget_usd is None else str(self.budget_usd)
        return out


@dataclass(frozen=True, slots=True)
class Subject:
    """Whose limits: a key (by id) or a tenant (by id)."""

    kind: SubjectKind
    id: str


def _limits(row) -> Limits:  # noqa: ANN001 - a SQLAlchemy row
    budget = None if row.budget_nusd is None else from_nano(row.budget_nusd)
    return Limits(row.rpm, row.tpm, row.max_concurrent, budget)


class LimitBook:
    """Reads and writes ``rate_limits``; names are resolved through the ``KeyStore``."""

    def __init__(self, store: KeyStore) -> None:
        self.store = store
        self.engine: Engine = store.engine

    def subject(self, *, key_id: str | None = None, tenant: str | None = None) -> Subject:
        """The key ``key_id`` or the tenant ``tenant`` (name or id), which must exist."""
        if (key_id is None) == (tenant is None):
            raise TenancyError("name a key or a tenant, not both", code="invalid_subject")
        if key_id is not None:
            with self.engine.connect() as db:
                found = db.execute(select(api_keys.c.id).where(api_keys.c.id == key_id)).scalar()
            if found is None:
                raise TenancyError(f"no key {key_id!r}", code="key_not_found")
            return Subject("key", key_id)
        record = self.store.tenant(tenant or "")
        if record is None:
            raise TenancyError(f"no tenant {tenant!r}", code="tenant_not_found")
        return Subject("tenant", record.id)

    def get(self, subject: Subject) -> Limits:
        with self.engine.connect() as db:
            row = db.execute(select(rate_limits).where(rate_limits.c.subject_id == subject.id)).first()
        return Limits() if row is None else _limits(row)

    def set(self, subject: Subject, limits: Limits) -> Limits:
        """Replace ``subject``'s limits (None fields: back to the gateway's default)."""
        values = {"rpm": limits.rpm, "tpm": limits.tpm, "max_concurrent": limits.max_concurrent,
                  "budget_nusd": None if limits.budget_usd is None else to_nano(limits.budget_usd),
                  "updated_at": datetime.now(UTC)}
        with self.engine.begin() as db:
            changed = db.execute(update(rate_limits).where(rate_limits.c.subject_id == subject.id).values(**values))
            if changed.rowcount == 0:
                db.execute(insert(rate_limits).values(subject_id=subject.id, subject_kind=subject.kind, **values))
        return self.get(subject)

    def update(self, subject: Subject, clear: tuple[str, ...] = (), **changes: int | Decimal) -> Limits:
        """Change some of ``subject``'s limits: ``changes`` set, ``clear`` unset (names from ``LIMIT_NAMES``)."""
        unknown = [n for n in (*clear, *changes) if n not in LIMIT_NAMES]
        if unknown:
            raise TenancyError(f"unknown limit {unknown[0]!r}; the limits are {', '.join(LIMIT_NAMES)}",
                               code="invalid_limit")
        current = self.get(subject)
        return self.set(subject, replace(current, **changes, **dict.fromkeys(clear)))

    def for_request(self, tenant_id: str, key_id: str | None) -> tuple[Limits, Limits]:
        """The limits set on ``key_id`` (empty for None) and on ``tenant_id``, in one query."""
        ids = [tenant_id] if key_id is None else [tenant_id, key_id]
        with self.engine.connect() as db:
            found = db.execute(select(rate_limits).where(rate_limits.c.subject_id.in_(ids)))
            rows = {r.subject_id: _limits(r) for r in found}
        return rows.get(key_id, Limits()) if key_id is not None else Limits(), rows.get(tenant_id, Limits())
