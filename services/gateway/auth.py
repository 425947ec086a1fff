"""Who is asking: the tenant behind ``Authorization: Bearer <key>``, and its prefix-cache salt.

With auth on, every /v1 request needs a key: none is 401 ``missing_api_key``; an unknown, revoked
or expired one is 401 ``invalid_api_key`` with one message for all three, so an answer never says
whether a key ever existed. With auth off (``crescent up``'s default) every request is the
``default`` tenant's and any Authorization header is ignored.

A key's check (a database read in a worker thread) is reused for ``key_cache_s`` (5 s by
default), refusals too, so unknown and revoked keys take the same path; a revocation therefore
takes effect on a gateway within ``key_cache_s``. The cache holds at most ``_CACHE_ENTRIES``
answers (oldest dropped first), so a flood of made-up keys cannot grow it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime

from fastapi import Request
from starlette.types import Scope
from sqlalchemy.exc import SQLAlchemyError

from crescent.services.common.metrics import gateway_metrics
from crescent.services.gateway.auth_throttle import FailedAuthThrottle
from crescent.services.gateway.config import AuthSettings
from crescent.services.gateway.errors import (
    AuthenticationError,
    PermissionDeniedError,
    RateLimitedError,
    ServiceUnavailableError,
)
from crescent.services.tenancy import DEFAULT_TENANT, KeyCheck, KeyStore, connect_database, hash_key, tenant_salt
from crescent.services.tenancy.database import server_secret

log = logging.getLogger(__name__)

_CACHE_ENTRIES = 10_000
DATABASE_CHECK_S = 2.0          # /health asks the database at most this often
DATABASE_PING_TIMEOUT_S = 2.0
DATABASE_RETRY_S = 5.0          # Retry-After of a request refused because the database is away
_MISSING = ("You didn't provide an API key. Send it in an Authorization header: "
            "'Authorization: Bearer crs-…' (keys come from `crescent keys create` or the /admin/keys API).")


@dataclass(frozen=True, slots=True)
class Principal:
    """The tenant a request belongs to, the key it came with (None with auth off) and the tenant's salt."""

    tenant_id: str
    key_id: str | None
    salt: bytes


def _masked(key: str) -> str:
    return f"{key[:8]}…{key[-4:]}" if len(key) > 16 else "…"


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, or None when there is none."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


class Authenticator:
    def __init__(self, settings: AuthSettings, store: KeyStore, secret: bytes) -> None:
        self.enabled = settings.enabled
        self.store = store
        self._secret = secret
        self._cache_s = settings.key_cache_s
        admin = settings.admin_key.get_secret_value() if settings.admin_key is not None else ""
        self._admin_hash = hashlib.sha256(admin.encode()).digest() if admin else None
        self._checked: OrderedDict[str, tuple[float, KeyCheck]] = OrderedDict()
        self._db_checked: tuple[float, str | None] = (-DATABASE_CHECK_S, None)  # (when, what was wrong)
        self._default = Principal(DEFAULT_TENANT, None, tenant_salt(secret, DEFAULT_TENANT))
        self._throttle = FailedAuthThrottle(settings.failed_auth_burst, settings.failed_auth_per_minute)

    @classmethod
    def open(cls, settings: AuthSettings) -> Authenticator:
        """Connect to the database (migrating it), make the default tenant, read or create the
        salt secret. Blocks: call it before serving or from a worker thread."""
        store = KeyStore(connect_database(settings.database_url))
        store.ensure_tenant(DEFAULT_TENANT)
        if settings.cache_salt_secret is not None:
            secret = settings.cache_salt_secret.get_secret_value().encode()
        else:
            secret = server_secret(store.engine, "cache_salt")
        return cls(settings, store, secret)

    def close(self) -> None:
        self.store.engine.dispose()

    @property
    def admin_enabled(self) -> bool:
        return self._admin_hash is not None

    def salt_of(self, tenant_id: str) -> bytes:
        return tenant_salt(self._secret, tenant_id)

    async def principal(self, authorization: str | None, source: str | None = None) -> Principal:
        """The tenant of a request with this Authorization header, or the 401 to answer (429 when
        ``source``, the client's address, sent too many invalid keys: ``auth_throttle``)."""
        if not self.enabled:
            return self._default
        key = bearer_key(authorization)
        if key is None:
            raise AuthenticationError(_MISSING, code="missing_api_key")
        digest = hash_key(key)
        self._refuse_if_throttled(source, digest)
        try:
            check = await self._check(key, digest)
        except SQLAlchemyError as exc:  # the database is away: say so, and let the client retry
            log.warning("API key check failed: the database is unreachable (%s)", exc.__class__.__name__)
            raise ServiceUnavailableError("the gateway cannot check API keys now: its database is unreachable",
                                          retry_after_s=DATABASE_RETRY_S, code="database_unavailable") from None
        if check.tenant_id is None:
            log.info("refused an API key (%s%s)", check.refusal, f": {check.key_id}" if check.key_id else "")
            self._throttle.failed(source)
            raise AuthenticationError(f"Incorrect API key provided: {_masked(key)}.", code="invalid_api_key")
        self._throttle.succeeded(digest)
        return Principal(check.tenant_id, check.key_id, self.salt_of(check.tenant_id))

    async def _check(self, key: str, digest: str) -> KeyCheck:
        now = time.monotonic()
        cached = self._checked.get(digest)
        if cached is not None and now - cached[0] < self._cache_s:
            check = cached[1]
            if check.expires_at is None or check.expires_at > datetime.now(UTC):
                return check
        check = await asyncio.to_thread(self.store.check, key)
        self._checked[digest] = (now, check)
        self._checked.move_to_end(digest)
        while len(self._checked) > _CACHE_ENTRIES:
            self._checked.popitem(last=False)
        return check

    def forget_key(self, key_id: str) -> None:
        """Drop cached answers about ``key_id`` (it was just revoked here)."""
        for digest in [d for d, (_, check) in self._checked.items() if check.key_id == key_id]:
            del self._checked[digest]

    async def database_ok(self) -> str | None:
        """None when the database answers (at most every ``DATABASE_CHECK_S``); else why not."""
        now = time.monotonic()
        if now - self._db_checked[0] >= DATABASE_CHECK_S:
            try:
                await asyncio.wait_for(asyncio.to_thread(self.store.ping), DATABASE_PING_TIMEOUT_S)
                problem = None
            except (SQLAlchemyError, TimeoutError) as exc:
                problem = f"database unreachable ({exc.__class__.__name__})"
            self._db_checked = (now, problem)
        return self._db_checked[1]

    def check_admin(self, authorization: str | None, source: str | None = None) -> None:
        """Raise unless the header carries the admin key (403 when no admin key is configured; 429
        when ``source`` sent too many invalid keys)."""
        if self._admin_hash is None:
            raise PermissionDeniedError("the admin API is off: set the gateway's auth.admin_key to use it")
        key = bearer_key(authorization)
        if key is None:
            raise AuthenticationError(_MISSING, code="missing_api_key")
        digest = hashlib.sha256(key.encode())
        hex_digest = digest.hexdigest()
        self._refuse_if_throttled(source, hex_digest)
        if not hmac.compare_digest(digest.digest(), self._admin_hash):
            self._throttle.failed(source)
            raise AuthenticationError(f"Incorrect admin key provided: {_masked(key)}.", code="invalid_api_key")
        self._throttle.succeeded(hex_digest)

    def _refuse_if_throttled(self, source: str | None, key_digest: str) -> None:
        wait_s = self._throttle.retry_after_s(source, key_digest)
        if wait_s > 0:
            gateway_metrics().auth_throttled.inc()
            raise RateLimitedError(
                f"too many requests with invalid API keys from {source}; keys from this address are checked "
                f"again in {wait_s:.0f} s", retry_after_s=wait_s, code="too_many_failed_auth")


def client_address(scope: Scope) -> str | None:
    """The client's address (uvicorn's: the peer, or X-Forwarded-For from a trusted proxy)."""
    client = scope.get("client")
    return client[0] if client else None


def principal_of(request: Request) -> Principal:
    """The principal ``authenticate`` put on the request (every /v1 route depends on it)."""
    return request.state.principal
