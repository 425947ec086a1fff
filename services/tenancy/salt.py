"""The prefix-cache salt of a request, derived on the server from its tenant.

``tenant_salt = HMAC-SHA256(secret, "crescent cache salt\\0" + tenant_id)``: tenants never share
blocks, and nobody without the secret can compute another tenant's salt. A client's
``cache_salt`` only narrows sharing inside its tenant: ``SHA-256(tenant_salt + "\\0" + client)``.
No client salt is the tenant's own salt; an empty one is a (distinct) client salt like any other.
"""

from __future__ import annotations

import hashlib
import hmac

_DOMAIN = b"crescent cache salt\0"


def tenant_salt(secret: bytes, tenant_id: str) -> bytes:
    if not secret:
        raise ValueError("the cache-salt secret is empty")
    return hmac.new(secret, _DOMAIN + tenant_id.encode(), hashlib.sha256).digest()


def cache_salt(tenant: bytes, client_salt: str | None) -> bytes:
    """The salt that goes into block keys for a request of the tenant whose salt is ``tenant``."""
    if client_salt is None:
        return tenant
    return hashlib.sha256(tenant + b"\0" + client_salt.encode()).digest()
