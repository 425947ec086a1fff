"""``crescent usage``: the usage ledger, read from the gateway's database directly (docs/usage.md).

The database is the gateway's, found as ``crescent keys`` finds it (``--database-url``, else the
settings' ``auth.database_url``). Totals over ``[--start, --end)`` grouped by ``--group-by``;
``--csv`` writes CSV to stdout: the groups, or without ``--group-by`` every request's row.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from crescent.services.keys_cli import ConfigOption, DatabaseOption, _fail, _print_rows, _store


def usage_command(
    start: Annotated[str | None, typer.Option(help="from (inclusive): ISO 8601 or Unix seconds; no zone: UTC")] = None,
    end: Annotated[str | None, typer.Option(help="until (exclusive): ISO 8601 or Unix seconds")] = None,
    group_by: Annotated[str, typer.Option(help="comma-separated: tenant, key, model, day, status")] = "",
    tenant: Annotated[str | None, typer.Option(help="only this tenant (name or id); default: every tenant")] = None,
    as_csv: Annotated[bool, typer.Option("--csv", help="CSV on stdout: groups, or every request's row")] = False,
    database_url: DatabaseOption = None,
    config: ConfigOption = None,
) -> None:
    """Usage and spend from the ledger: requests, tokens (cached, reasoning), cost and cache savings."""
    from crescent.services.tenancy.usage import UsageQuery, UsageStore
    from crescent.services.tenancy.usage_report import (
        SUMS, parse_group_by, parse_moment, rows_csv, rows_csv_header, totals_csv, usd,
    )

    try:
        groups = parse_group_by(group_by)
        since = parse_moment(start) if start else None
        until = parse_moment(end) if end else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    keys = _store(database_url, config)
    tenant_id = None
    if tenant is not None:
        found = keys.tenant(tenant)
        if found is None:
            _fail(ValueError(f"no tenant {tenant!r}"))
        tenant_id = found.id
    store = UsageStore(keys.engine)
    query = UsageQuery(since, until, tenant_id)
    if as_csv and not groups:
        sys.stdout.write(rows_csv_header())
        sys.stdout.write(rows_csv(store.all_rows(query)))
        return
    totals = store.totals(query, groups)
    if as_csv:
        sys.stdout.write(totals_csv(totals, groups))
        return
    _print_rows((*groups, *SUMS, "cost_usd", "cache_savings_usd"), [
        (*(str(t.group[g] or "-") for g in groups), *(str(getattr(t, s)) for s in SUMS),
         usd(t.cost_nusd), usd(t.savings_nusd)) for t in totals])
