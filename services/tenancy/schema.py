"""The gateway database's tables (SQLAlchemy Core). Alembic migrations in ``migrations/`` create
them; this module is what the code reads and writes through.

Ids are stable strings (``default``, ``ten_…``, ``key_…``) so that later tables can point at them:
a usage ledger is meant to be one row per request, ``usage(request_id PRIMARY KEY, tenant_id →
tenants.id, api_key_id → api_keys.id NULL, created_at, prompt_tokens, cached_tokens,
completion_tokens, price…)``, added by its own migration to the same database.
"""

from __future__ import annotations

from sqlalchemy import Column, DateTime, ForeignKey, Index, LargeBinary, MetaData, String, Table

metadata = MetaData()

tenants = Table(
    "tenants", metadata,
    Column("id", String(64), primary_key=True),            # "default" or ten_<hex>; never reused
    Column("name", String(200), nullable=False, unique=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
)

api_keys = Table(
    "api_keys", metadata,
    Column("id", String(64), primary_key=True),            # key_<hex>: what list/revoke name
    Column("tenant_id", String(64), ForeignKey("tenants.id"), nullable=False),
    Column("name", String(200), nullable=False),
    Column("key_prefix", String(16), nullable=False),      # the key's first characters, to recognise it
    Column("key_hash", String(64), nullable=False),        # SHA-256 hex of the whole key; the key itself is never stored
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=True),
    Column("revoked_at", DateTime(timezone=True), nullable=True),
    Index("ix_api_keys_key_hash", "key_hash", unique=True),
    Index("ix_api_keys_tenant_id", "tenant_id"),
)

server_secrets = Table(
    "server_secrets", metadata,
    Column("name", String(64), primary_key=True),          # e.g. "cache_salt"
    Column("value", LargeBinary, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
)
