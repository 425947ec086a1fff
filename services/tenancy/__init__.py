"""Tenants, API keys and the cache salt derived from a tenant, in the gateway's database."""

from crescent.services.tenancy.database import connect_database
from crescent.services.tenancy.keys import (
    DEFAULT_TENANT, ApiKeyRecord, CreatedKey, KeyCheck, KeyStore, TenantRecord, TenancyError, hash_key, new_key,
)
from crescent.services.tenancy.salt import cache_salt, tenant_salt

__all__ = [
    "DEFAULT_TENANT", "ApiKeyRecord", "CreatedKey", "KeyCheck", "KeyStore", "TenantRecord", "TenancyError",
    "cache_salt", "connect_database", "hash_key", "new_key", "tenant_salt",
]
