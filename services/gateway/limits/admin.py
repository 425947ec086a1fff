"""The admin API of rate limits and budgets, behind the admin key like the rest of ``/admin``.

``GET /admin/keys/{key_id}/limits`` and ``GET /admin/tenants/{tenant}/limits`` answer the limits
set on that key or tenant and the ones in force (unset ones from the gateway's defaults);
``PUT`` the same paths with ``{"rpm", "tpm", "max_concurrent", "budget_usd"}`` replaces the set
ones (a missing or null field: back to the default). This gateway applies a change at once,
other gateways within ``auth.key_cache_s``.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from crescent.services.gateway.auth import Authenticator, client_address
from crescent.services.gateway.errors import ApiError, InvalidRequestError, NotFoundError
from crescent.services.gateway.limits.settings import LimitSettings, LimitValues
from crescent.services.gateway.limits.limiter import RateLimiter
from crescent.services.tenancy.keys import TenancyError
from crescent.services.tenancy.limits import LimitBook, Limits, Subject


class LimitsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1)
    budget_usd: Decimal | None = Field(default=None, ge=0, description="US dollars per calendar month (UTC)")


def _api_error(exc: TenancyError) -> ApiError:
    if exc.code.endswith("_not_found"):
        return NotFoundError(str(exc), code=exc.code)
    return InvalidRequestError(str(exc), code=exc.code)


def _defaults(values: LimitValues) -> Limits:
    return Limits(values.rpm, values.tpm, values.max_concurrent, values.budget_usd)


def limits_json(subject: Subject, limits: Limits, settings: LimitSettings) -> dict[str, Any]:
    default = _defaults(settings.key if subject.kind == "key" else settings.tenant)
    return {"object": "rate_limits", "subject": {"kind": subject.kind, "id": subject.id},
            "limits": limits.as_dict(), "effective": limits.over(default).as_dict()}


def limits_router(auth: Authenticator, limiter: RateLimiter, settings: LimitSettings) -> APIRouter:
    book = LimitBook(auth.store)

    async def admin_only(request: Request) -> None:
        auth.check_admin(request.headers.get("authorization"), client_address(request.scope))

    router = APIRouter(prefix="/admin", dependencies=[Depends(admin_only)], include_in_schema=False)

    async def call(fn, *args):  # noqa: ANN001, ANN202 - a LimitBook method and its arguments
        try:
            return await asyncio.to_thread(fn, *args)
        except TenancyError as exc:
            raise _api_error(exc) from None

    async def show(subject: Subject) -> JSONResponse:
        return JSONResponse(limits_json(subject, await call(book.get, subject), settings))

    async def replace(subject: Subject, body: LimitsBody) -> JSONResponse:
        limits = await call(book.set, subject, Limits(body.rpm, body.tpm, body.max_concurrent, body.budget_usd))
        limiter.forget(subject.id)
        return JSONResponse(limits_json(subject, limits, settings))

    @router.get("/keys/{key_id}/limits")
    async def key_limits(key_id: str) -> JSONResponse:
        return await show(await call(lambda: book.subject(key_id=key_id)))

    @router.put("/keys/{key_id}/limits")
    async def set_key_limits(key_id: str, body: LimitsBody) -> JSONResponse:
        return await replace(await call(lambda: book.subject(key_id=key_id)), body)

    @router.get("/tenants/{tenant}/limits")
    async def tenant_limits(tenant: str) -> JSONResponse:
        return await show(await call(lambda: book.subject(tenant=tenant)))

    @router.put("/tenants/{tenant}/limits")
    async def set_tenant_limits(tenant: str, body: LimitsBody) -> JSONResponse:
        return await replace(await call(lambda: book.subject(tenant=tenant)), body)

    return router
