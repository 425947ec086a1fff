"""The admin HTTP API: tenants and API keys, behind the admin key (``auth.admin_key``).

``POST /admin/tenants {"name"}``, ``GET /admin/tenants``; ``POST /admin/keys {"tenant", "name",
"expires_in_s"}`` (the answer is the only place the key ever appears), ``GET /admin/keys[?tenant=]``,
``POST /admin/keys/{id}/revoke``. Left out of the OpenAPI document: it is not the model API.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from crescent.services.gateway.auth import Authenticator, client_address
from crescent.services.gateway.errors import ApiError, InvalidRequestError, NotFoundError
from crescent.services.tenancy import ApiKeyRecord, TenancyError, TenantRecord


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str = Field(min_length=1, description="tenant name or id")
    name: str = Field(default="", max_length=200)
    expires_in_s: float | None = Field(default=None, gt=0, description="lifetime; none: until revoked")
    create_tenant: bool = Field(default=False, description="make the tenant if it does not exist")


class ConflictError(InvalidRequestError):
    status = 409


def _api_error(exc: TenancyError) -> ApiError:
    if exc.code.endswith("_not_found"):
        return NotFoundError(str(exc), code=exc.code)
    if exc.code == "tenant_exists":
        return ConflictError(str(exc), code=exc.code)
    return InvalidRequestError(str(exc), code=exc.code)


def _stamp(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def tenant_json(t: TenantRecord) -> dict[str, Any]:
    return {"object": "tenant", "id": t.id, "name": t.name, "created_at": _stamp(t.created_at)}


def key_json(k: ApiKeyRecord) -> dict[str, Any]:
    return {"object": "api_key", "id": k.id, "tenant_id": k.tenant_id, "name": k.name,
            "key_prefix": k.key_prefix, "status": k.status(datetime.now(UTC)), "created_at": _stamp(k.created_at),
            "expires_at": _stamp(k.expires_at), "revoked_at": _stamp(k.revoked_at)}


def admin_router(auth: Authenticator) -> APIRouter:
    async def admin_only(request: Request) -> None:
        auth.check_admin(request.headers.get("authorization"), client_address(request.scope))

    router = APIRouter(prefix="/admin", dependencies=[Depends(admin_only)], include_in_schema=False)

    async def call(fn, *args, **kwargs):  # noqa: ANN001, ANN202 - a KeyStore method and its arguments
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except TenancyError as exc:
            raise _api_error(exc) from None

    @router.get("/tenants")
    async def list_tenants() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [tenant_json(t) for t in await call(auth.store.list_tenants)]})

    @router.post("/tenants")
    async def create_tenant(body: TenantCreate) -> JSONResponse:
        return JSONResponse(tenant_json(await call(auth.store.create_tenant, body.name)), status_code=201)

    @router.get("/keys")
    async def list_keys(tenant: str | None = None) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [key_json(k) for k in await call(auth.store.list_keys, tenant)]})

    @router.post("/keys")
    async def create_key(body: KeyCreate) -> JSONResponse:
        expires = timedelta(seconds=body.expires_in_s) if body.expires_in_s is not None else None
        created = await call(auth.store.create_key, body.tenant, body.name, expires_in=expires,
                             create_tenant=body.create_tenant)
        return JSONResponse(key_json(created.record) | {"key": created.key}, status_code=201)

    @router.post("/keys/{key_id}/revoke")
    async def revoke_key(key_id: str) -> JSONResponse:
        record = await call(auth.store.revoke_key, key_id)
        auth.forget_key(key_id)  # this gateway at once; others within their key_cache_s
        return JSONResponse(key_json(record))

    return router
