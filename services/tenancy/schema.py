"""The gateway database's tables (SQLAlchemy Core). Alembic migrations in ``migrations/`` create
them; this module is what the code reads and writes through.

Ids are stable strings (``default``, ``ten_…``, ``key_…``) so that later tables can point at them,
as the usage ledger does: one row per request, keyed by the request id (``tenancy/usage.py``).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger, Column, DateTime, Float, ForeignKey, Index, Integer, LargeBinary, MetaData, String, Table,
)

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

usage = Table(
    "usage", metadata,
    Column("request_id", String(100), primary_key=True),   # the id the client got (chatcmpl-…, cmpl-…, resp_…)
    Column("created_at", DateTime(timezone=True), nullable=False),  # when the request arrived (UTC)
    Column("tenant_id", String(64), ForeignKey("tenants.id"), nullable=False),
    Column("api_key_id", String(64), ForeignKey("api_keys.id"), nullable=True),  # none with auth off
    Column("model", String(200), nullable=False),          # the served model name the request used
    Column("status", String(16), nullable=False),          # ok, client_error, rejected, error, cancelled
    Column("prompt_tokens", Integer, nullable=False),
    Column("cached_tokens", Integer, nullable=False),      # prompt tokens served from the KV cache
    Column("completion_tokens", Integer, nullable=False),  # reasoning included
    Column("reasoning_tokens", Integer, nullable=False),
    Column("ttft_s", Float, nullable=True),                # none: no token was generated
    Column("cost_nusd", BigInteger, nullable=False),       # price in nano-dollars (1e-9 USD), exact sums
    Column("savings_nusd", BigInteger, nullable=False),    # what the cache hits saved, nano-dollars
    Index("ix_usage_tenant_created", "tenant_id", "created_at"),
    Index("ix_usage_created", "created_at"),
)
