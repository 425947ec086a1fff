"""``GET /v1/usage``: a tenant's own usage; ``GET /admin/usage``: any tenant's, behind the admin key.

Parameters (docs/usage.md): ``start`` and ``end`` (ISO 8601 or Unix seconds; the range is
``[start, end)``, either may be left open), ``group_by`` (comma-separated: tenant, key, model,
day, status), ``format`` (``json``, the default, or ``csv``; ``Accept: text/csv`` also asks
for CSV), and on the admin route ``tenant`` (a name or id; none: every tenant). JSON gives the
totals per group and overall; CSV gives the groups, or without ``group_by`` every request's row
(streamed a page at a time). Anything else in the query, or a value that does not parse, is a
400 naming the parameter.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from crescent.services.gateway.auth import Authenticator, client_address
from crescent.services.gateway.errors import InvalidRequestError, NotFoundError
from crescent.services.tenancy.usage import UsageQuery, UsageStore
from crescent.services.tenancy.usage_report import (
    parse_group_by, parse_moment, rows_csv, rows_csv_header, totals_csv, totals_json,
)

_PARAMS = ("start", "end", "group_by", "format")
_PAGE = 1000
_CSV_HEADERS = {"Content-Disposition": 'attachment; filename="usage.csv"'}

DOCUMENTED_RESPONSES: dict[int | str, dict[str, object]] = {
    200: {"description": "totals (JSON) or rows/groups (CSV)",
          "content": {"application/json": {"schema": {"type": "object"}}, "text/csv": {"schema": {"type": "string"}}}},
}


class UsageApi:
    """Answers usage queries from ``store`` (None: the ledger is off, and every query is a 404)."""

    def __init__(self, store: UsageStore | None, auth: Authenticator) -> None:
        self._store = store
        self._auth = auth

    async def answer(self, request: Request, tenant_id: str | None, *, admin: bool) -> Response:
        """The usage ``request`` asks for, of ``tenant_id`` (the admin route: the ``tenant`` parameter's, or all)."""
        params = request.query_params
        allowed = (*_PARAMS, "tenant") if admin else _PARAMS
        for name in params:
            if name not in allowed:
                hint = " (only /admin/usage reads another tenant's usage)" if name == "tenant" else ""
                raise InvalidRequestError(f"unknown parameter {name!r}{hint}; this endpoint takes "
                                          f"{', '.join(allowed)}", param=name, code="unknown_parameter")
            if len(params.getlist(name)) > 1:
                raise InvalidRequestError(f"{name!r} is given more than once", param=name)
        start, end = _moment(params.get("start"), "start"), _moment(params.get("end"), "end")
        if start is not None and end is not None and start >= end:
            raise InvalidRequestError("end must be later than start", param="end", code="invalid_value")
        try:
            group_by = parse_group_by(params.get("group_by", ""))
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="group_by", code="invalid_value") from None
        fmt = params.get("format") or ("csv" if "text/csv" in request.headers.get("accept", "") else "json")
        if fmt not in ("json", "csv"):
            raise InvalidRequestError(f"format {fmt!r}: json or csv", param="format", code="invalid_value")
        if self._store is None:
            raise NotFoundError("the usage ledger is off on this gateway (ledger.enabled)", code="ledger_off")
        if admin and params.get("tenant"):
            tenant_id = await self._tenant_id(params["tenant"])
        query = UsageQuery(start, end, tenant_id)
        if fmt == "csv" and not group_by:
            return StreamingResponse(self._rows(query), media_type="text/csv", headers=_CSV_HEADERS)
        totals = await asyncio.to_thread(self._store.totals, query, group_by)
        if fmt == "csv":
            return Response(totals_csv(totals, group_by), media_type="text/csv", headers=_CSV_HEADERS)
        return JSONResponse(totals_json(totals, group_by, start, end))

    async def _tenant_id(self, name_or_id: str) -> str:
        found = await asyncio.to_thread(self._auth.store.tenant, name_or_id)
        if found is None:
            raise NotFoundError(f"no tenant {name_or_id!r}", param="tenant", code="tenant_not_found")
        return found.id

    async def _rows(self, query: UsageQuery) -> AsyncIterator[str]:
        assert self._store is not None
        yield rows_csv_header()
        after = None
        while True:
            page = await asyncio.to_thread(self._store.rows, query, after=after, limit=_PAGE)
            if page:
                yield rows_csv(page)
            if len(page) < _PAGE:
                return
            after = (page[-1].created_at, page[-1].request_id)


def _moment(text: str | None, param: str) -> datetime | None:
    if text is None or text == "":
        return None
    try:
        return parse_moment(text)
    except ValueError as exc:
        raise InvalidRequestError(f"{param}: {exc}", param=param, code="invalid_value") from None


def usage_admin_router(api: UsageApi, auth: Authenticator) -> APIRouter:
    """``GET /admin/usage``, behind the admin key like the rest of /admin."""

    async def admin_only(request: Request) -> None:
        auth.check_admin(request.headers.get("authorization"), client_address(request.scope))

    router = APIRouter(prefix="/admin", dependencies=[Depends(admin_only)], include_in_schema=False)

    @router.get("/usage")
    async def admin_usage(request: Request) -> Response:
        return await api.answer(request, None, admin=True)

    return router
