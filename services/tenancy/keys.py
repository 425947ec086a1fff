"""Tenants and their API keys.

A key is ``crs-`` + 43 characters of base64url (256 random bits). Only its SHA-256 is stored, so
a leaked database yields no usable key; a key is shown once, when it is created. A lookup finds
the row by that hash (an index) and compares the hashes in constant time; unknown, revoked and
expired keys take the same path and differ only in the answer. Ids are ``ten_…`` and ``key_…``;
the tenant of the open (no-auth) mode is ``default``.

``KeyStore`` methods block (database calls): the gateway runs them in a worker thread.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, insert, select, text, update
from sqlalchemy.exc import IntegrityError

from crescent.services.tenancy.schema import api_keys, tenants

KEY_PREFIX = "crs-"
DEFAULT_TENANT = "default"
_SHOWN_PREFIX = 12  # characters of a key kept in clear to recognise it (crs- + 8)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")
_NO_MATCH = "0" * 64


class TenancyError(ValueError):
    """A request about tenants or keys that cannot be done (unknown tenant, bad name, …)."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class TenantRecord:
    id: str
    name: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    id: str
    tenant_id: str
    name: str
    key_prefix: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None

    def status(self, now: datetime) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"


@dataclass(frozen=True, slots=True)
class CreatedKey:
    record: ApiKeyRecord
    key: str  # the only time the key itself exists outside the client


@dataclass(frozen=True, slots=True)
class KeyCheck:
    """What a presented key is worth: its tenant, or why not (``unknown``, ``revoked``, ``expired``)."""

    tenant_id: str | None
    key_id: str | None
    refusal: str | None
    expires_at: datetime | None = None


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _aware(moment: datetime | None) -> datetime | None:
    """SQLite gives back naive datetimes; every stored one is UTC."""
    return moment.replace(tzinfo=UTC) if moment is not None and moment.tzinfo is None else moment


def _key_record(row) -> ApiKeyRecord:  # noqa: ANN001 - a SQLAlchemy row
    return ApiKeyRecord(row.id, row.tenant_id, row.name, row.key_prefix, _aware(row.created_at),
                        _aware(row.expires_at), _aware(row.revoked_at))


class KeyStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def ping(self) -> None:
        """Raise (SQLAlchemyError) unless the database answers a trivial query."""
        with self.engine.connect() as db:
            db.execute(text("SELECT 1"))

    # ---- tenants ---------------------------------------------------------------------------

    def ensure_tenant(self, name: str, tenant_id: str | None = None) -> TenantRecord:
        """The tenant called ``name``, created if it does not exist yet (``default`` gets id ``default``)."""
        existing = self.tenant(name)
        if existing is not None:
            return existing
        try:
            return self.create_tenant(name, tenant_id)
        except TenancyError:  # created by another process meanwhile
            found = self.tenant(name)
            if found is None:
                raise
            return found

    def create_tenant(self, name: str, tenant_id: str | None = None) -> TenantRecord:
        if not _NAME.match(name):
            raise TenancyError(f"tenant name {name!r}: letters, digits, '_', '-', '.' (up to 200)", code="invalid_name")
        record = TenantRecord(tenant_id or (DEFAULT_TENANT if name == DEFAULT_TENANT else f"ten_{secrets.token_hex(8)}"),
                              name, datetime.now(UTC))
        try:
            with self.engine.begin() as db:
                db.execute(insert(tenants).values(id=record.id, name=record.name, created_at=record.created_at))
        except IntegrityError:
            raise TenancyError(f"a tenant called {name!r} exists already", code="tenant_exists") from None
        return record

    def tenant(self, name_or_id: str) -> TenantRecord | None:
        with self.engine.connect() as db:
            row = db.execute(select(tenants).where((tenants.c.name == name_or_id) | (tenants.c.id == name_or_id))).first()
        return None if row is None else TenantRecord(row.id, row.name, _aware(row.created_at))

    def list_tenants(self) -> list[TenantRecord]:
        with self.engine.connect() as db:
            rows = db.execute(select(tenants).order_by(tenants.c.created_at, tenants.c.id)).all()
        return [TenantRecord(r.id, r.name, _aware(r.created_at)) for r in rows]

    # ---- keys ------------------------------------------------------------------------------

    def create_key(self, tenant: str, name: str = "", *, expires_in: timedelta | None = None,
                   create_tenant: bool = False) -> CreatedKey:
        """A new key for ``tenant`` (name or id); with ``create_tenant`` the tenant is made if missing."""
        found = self.ensure_tenant(tenant) if create_tenant else self.tenant(tenant)
        if found is None:
            raise TenancyError(f"no tenant {tenant!r}; create it first", code="tenant_not_found")
        if expires_in is not None and expires_in <= timedelta(0):
            raise TenancyError("a key's lifetime must be positive", code="invalid_expiry")
        key = new_key()
        now = datetime.now(UTC)
        record = ApiKeyRecord(f"key_{secrets.token_hex(8)}", found.id, name or "", key[:_SHOWN_PREFIX], now,
                              now + expires_in if expires_in is not None else None, None)
        with self.engine.begin() as db:
            db.execute(insert(api_keys).values(
                id=record.id, tenant_id=record.tenant_id, name=record.name, key_prefix=record.key_prefix,
                key_hash=hash_key(key), created_at=record.created_at, expires_at=record.expires_at))
        return CreatedKey(record, key)

    def list_keys(self, tenant: str | None = None) -> list[ApiKeyRecord]:
        query = select(api_keys).order_by(api_keys.c.created_at, api_keys.c.id)
        if tenant is not None:
            found = self.tenant(tenant)
            if found is None:
                raise TenancyError(f"no tenant {tenant!r}", code="tenant_not_found")
            query = query.where(api_keys.c.tenant_id == found.id)
        with self.engine.connect() as db:
            return [_key_record(r) for r in db.execute(query).all()]

    def revoke_key(self, key_id: str) -> ApiKeyRecord:
        """Revoke ``key_id`` (revoking twice keeps the first time); gateways stop taking it within
        their key-cache lifetime."""
        with self.engine.begin() as db:
            db.execute(update(api_keys).where((api_keys.c.id == key_id) & api_keys.c.revoked_at.is_(None))
                       .values(revoked_at=datetime.now(UTC)))
            row = db.execute(select(api_keys).where(api_keys.c.id == key_id)).first()
        if row is None:
            raise TenancyError(f"no key {key_id!r}", code="key_not_found")
        return _key_record(row)

    def check(self, key: str, now: datetime | None = None) -> KeyCheck:
        """What ``key`` (as presented) is worth now."""
        digest = hash_key(key)
        with self.engine.connect() as db:
            row = db.execute(select(api_keys.c.id, api_keys.c.tenant_id, api_keys.c.key_hash, api_keys.c.expires_at,
                                    api_keys.c.revoked_at).where(api_keys.c.key_hash == digest)).first()
        matches = hmac.compare_digest(digest, row.key_hash if row is not None else _NO_MATCH)
        if row is None or not matches:
            return KeyCheck(None, None, "unknown")
        now = now or datetime.now(UTC)
        expires_at = _aware(row.expires_at)
        if row.revoked_at is not None:
            return KeyCheck(None, row.id, "revoked")
        if expires_at is not None and expires_at <= now:
            return KeyCheck(None, row.id, "expired")
        return KeyCheck(row.tenant_id, row.id, None, expires_at)
