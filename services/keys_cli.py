"""``crescent keys``: tenants and API keys in the gateway's database (docs/security.md).

The database is the gateway's: ``--database-url``, else the gateway settings' ``auth.database_url``
(``--config FILE`` or ``CRESCENT_GATEWAY__AUTH__DATABASE_URL``). ``create`` prints the new key
alone on stdout, once; it is stored only as a hash.
"""

from __future__ import annotations

import re
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

keys_app = typer.Typer(add_completion=False, no_args_is_help=True, help="API keys and tenants (gateway auth).")
console = Console(stderr=True)

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}

DatabaseOption = Annotated[str | None, typer.Option(
    "--database-url", help="SQLAlchemy URL; default: the gateway settings' auth.database_url")]
ConfigOption = Annotated[Path | None, typer.Option(help="gateway YAML settings to read auth.database_url from")]
RpmOption = Annotated[int | None, typer.Option("--rpm", min=1, help="requests per minute")]
TpmOption = Annotated[int | None, typer.Option("--tpm", min=1, help="weighted tokens per minute")]
ConcurrentOption = Annotated[int | None, typer.Option("--max-concurrent", min=1, help="requests in flight at once")]
BudgetOption = Annotated[str | None, typer.Option("--budget-usd", help="US dollars per calendar month (UTC)")]


def _store(database_url: str | None, config: Path | None):  # noqa: ANN202 - a KeyStore
    from crescent.services.gateway.config import load_gateway_settings
    from crescent.services.tenancy import KeyStore, connect_database

    url = database_url or load_gateway_settings(config).auth.database_url
    return KeyStore(connect_database(url))


def auth_status() -> tuple[str | tuple[str, str], ...]:
    """The line ``crescent up`` prints about API keys (the gateway's settings as its environment sets them)."""
    from crescent.services.common.settings import SettingsError
    from crescent.services.gateway.config import load_gateway_settings

    try:
        enabled = load_gateway_settings(None).auth.enabled
    except SettingsError:
        return ("API keys: see the gateway's log",)
    if enabled:
        return (("API keys: on", "bold"), " — create one with `crescent keys create TENANT` (docs/security.md)")
    return (("API keys: off", "bold yellow"), " — every caller is the one 'default' tenant (local use; "
            "CRESCENT_GATEWAY__AUTH__ENABLED=true turns them on, docs/security.md)")


def parse_duration(text: str) -> timedelta:
    match = _DURATION.match(text.strip())
    if match is None:
        raise typer.BadParameter("a number and a unit: 45s, 30m, 12h, 90d")
    return timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])


def _when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if moment is not None else "-"


def _print_rows(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A table on a terminal; tab-separated lines (header first) when piped, for scripts."""
    if not sys.stdout.isatty():
        for row in (columns, *rows):
            sys.stdout.write("\t".join(row) + "\n")
        return
    table = Table()
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def _fail(exc: Exception) -> None:
    console.print(f"[red]error:[/red] {exc}", highlight=False)
    raise typer.Exit(1)


@keys_app.command()
def create(
    tenant: Annotated[str, typer.Argument(help="tenant name (or id); made if it does not exist")],
    name: Annotated[str, typer.Option(help="a label for the key, e.g. who holds it")] = "",
    expires_in: Annotated[str | None, typer.Option(help="lifetime: 45s, 30m, 12h, 90d; default: until revoked")] = None,
    rpm: RpmOption = None,
    tpm: TpmOption = None,
    max_concurrent: ConcurrentOption = None,
    budget_usd: BudgetOption = None,
    database_url: DatabaseOption = None,
    config: ConfigOption = None,
) -> None:
    """Create an API key for TENANT and print it once (only its hash is kept); limits left out are
    the gateway's defaults (docs/limits.md)."""
    from crescent.services.tenancy import TenancyError
    from crescent.services.tenancy.limits import Limits, Subject

    lifetime = parse_duration(expires_in) if expires_in is not None else None
    changes = _limit_changes(rpm, tpm, max_concurrent, budget_usd)
    store = _store(database_url, config)
    try:
        limits = Limits(**changes)  # checked before the key exists
        created = store.create_key(tenant, name, expires_in=lifetime, create_tenant=True)
        if changes:
            _limit_book(store).set(Subject("key", created.record.id), limits)
    except TenancyError as exc:
        _fail(exc)
    record = created.record
    console.print(f"created key {record.id} for tenant {record.tenant_id} ({tenant}), expires: {_when(record.expires_at)}"
                  "\nthe key is shown this once; store it now:", highlight=False)
    sys.stdout.write(created.key + "\n")


@keys_app.command("list")
def list_keys(
    tenant: Annotated[str | None, typer.Option(help="only this tenant's keys (name or id)")] = None,
    database_url: DatabaseOption = None,
    config: ConfigOption = None,
) -> None:
    """List keys (ids, prefixes, status; never the keys)."""
    from crescent.services.tenancy import TenancyError

    store = _store(database_url, config)
    try:
        records = store.list_keys(tenant)
    except TenancyError as exc:
        _fail(exc)
    names = {t.id: t.name for t in store.list_tenants()}
    now = datetime.now(UTC)
    _print_rows(("id", "tenant", "name", "prefix", "status", "created", "expires", "revoked"), [
        (r.id, names.get(r.tenant_id, r.tenant_id), r.name, r.key_prefix + "…", r.status(now),
         _when(r.created_at), _when(r.expires_at), _when(r.revoked_at)) for r in records])


@keys_app.command()
def revoke(
    key_id: Annotated[str, typer.Argument(help="the key's id (key_…), as `crescent keys list` shows it")],
    database_url: DatabaseOption = None,
    config: ConfigOption = None,
) -> None:
    """Revoke a key: gateways refuse it within their key cache time (auth.key_cache_s, 5 s by default)."""
    from crescent.services.tenancy import TenancyError

    try:
        record = _store(database_url, config).revoke_key(key_id)
    except TenancyError as exc:
        _fail(exc)
    console.print(f"revoked {record.id} (tenant {record.tenant_id}) at {_when(record.revoked_at)}", highlight=False)


@keys_app.command()
def tenants(database_url: DatabaseOption = None, config: ConfigOption = None) -> None:
    """List tenants."""
    _print_rows(("id", "name", "created"),
                [(t.id, t.name, _when(t.created_at)) for t in _store(database_url, config).list_tenants()])


def _limit_book(store):  # noqa: ANN001, ANN202 - a KeyStore, a LimitBook
    from crescent.services.tenancy.limits import LimitBook

    return LimitBook(store)


def _limit_changes(rpm: int | None, tpm: int | None, max_concurrent: int | None, budget_usd: str | None) -> dict:
    from decimal import Decimal, InvalidOperation

    changes: dict = {"rpm": rpm, "tpm": tpm, "max_concurrent": max_concurrent}
    if budget_usd is not None:
        try:
            changes["budget_usd"] = Decimal(budget_usd)
        except InvalidOperation:
            raise typer.BadParameter(f"--budget-usd: not a number of dollars: {budget_usd!r}") from None
    return {name: value for name, value in changes.items() if value is not None}


@keys_app.command()
def limits(
    key_id: Annotated[str | None, typer.Argument(help="the key's id (key_…); or --tenant")] = None,
    tenant: Annotated[str | None, typer.Option(help="a tenant (name or id) instead of a key")] = None,
    rpm: RpmOption = None,
    tpm: TpmOption = None,
    max_concurrent: ConcurrentOption = None,
    budget_usd: BudgetOption = None,
    clear: Annotated[list[str] | None, typer.Option(
        help="set a limit back to the gateway's default: rpm, tpm, max_concurrent, budget_usd (repeatable)")] = None,
    database_url: DatabaseOption = None,
    config: ConfigOption = None,
) -> None:
    """Show a key's or tenant's rate limits and budget; with options, change them first.

    Gateways apply a change within their key cache time (auth.key_cache_s, 5 s by default).
    """
    from crescent.services.tenancy import TenancyError

    book = _limit_book(_store(database_url, config))
    try:
        subject = book.subject(key_id=key_id, tenant=tenant)
        changes = _limit_changes(rpm, tpm, max_concurrent, budget_usd)
        current = book.update(subject, tuple(clear or ()), **changes) if changes or clear else book.get(subject)
    except TenancyError as exc:
        _fail(exc)
    _print_rows(("subject", "rpm", "tpm", "max_concurrent", "budget_usd"), [(
        f"{subject.kind} {subject.id}",
        *("default" if value is None else str(value) for value in current.as_dict().values()))])
