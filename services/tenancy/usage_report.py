"""Reading the usage ledger for people: the parameters ``GET /v1/usage`` and ``crescent usage``
share (a moment, a grouping) and the JSON and CSV they answer with.

A moment is ISO 8601 (``2026-03-01``, ``2026-03-01T12:00:00Z``, ``…+09:00``; no zone: UTC) or
Unix seconds. Money is US dollars: exact decimal strings in CSV, numbers in JSON.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from crescent.services.tenancy.usage import GROUPS, UsageRow, UsageTotals, from_nano

ROW_COLUMNS = ("request_id", "created_at", "tenant_id", "api_key_id", "model", "status", "prompt_tokens",
               "cached_tokens", "completion_tokens", "reasoning_tokens", "ttft_s", "cost_usd", "cache_savings_usd")
SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens")


def parse_moment(text: str) -> datetime:
    """``text`` as an aware UTC datetime; ValueError saying what is accepted."""
    text = text.strip()
    try:
        if text.lstrip("-").replace(".", "", 1).isdigit():
            return datetime.fromtimestamp(float(text), UTC)
        moment = datetime.fromisoformat(text)
    except (ValueError, OverflowError, OSError):
        raise ValueError(f"{text!r} is not a time: give ISO 8601 (2026-03-01, 2026-03-01T12:00:00Z) "
                         "or Unix seconds") from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def parse_group_by(text: str) -> tuple[str, ...]:
    """A comma-separated grouping (``model,day``); ValueError naming what is wrong."""
    groups = tuple(part.strip() for part in text.split(",") if part.strip())
    for group in groups:
        if group not in GROUPS:
            raise ValueError(f"cannot group usage by {group!r}; choose from {', '.join(GROUPS)}")
    if len(set(groups)) != len(groups):
        raise ValueError(f"{text!r} names a grouping twice")
    return groups


def usd(nusd: int) -> str:
    """Nano-dollars as an exact decimal string with nine places."""
    return f"{from_nano(nusd):.9f}"


def _stamp(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _sums(totals: Iterable[UsageTotals]) -> dict[str, Any]:
    found = list(totals)
    out: dict[str, Any] = {name: sum(getattr(t, name) for t in found) for name in SUMS}
    cost, savings = sum(t.cost_nusd for t in found), sum(t.savings_nusd for t in found)
    return out | {"cost_usd": float(from_nano(cost)), "cache_savings_usd": float(from_nano(savings))}


def totals_json(totals: Sequence[UsageTotals], group_by: Sequence[str], start: datetime | None,
                end: datetime | None) -> dict[str, Any]:
    """The JSON of ``GET /v1/usage``: one entry per group (its grouping values first; without
    ``group_by`` one entry, if any request matched), and the total."""
    return {
        "object": "usage", "currency": "usd", "start": _stamp(start), "end": _stamp(end), "group_by": list(group_by),
        "data": [dict(t.group) | _sums([t]) for t in totals],
        "total": _sums(totals),
    }


def _csv_line(values: Sequence[Any]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow(["" if v is None else v for v in values])
    return out.getvalue()


def totals_csv(totals: Sequence[UsageTotals], group_by: Sequence[str]) -> str:
    lines = [_csv_line([*group_by, *SUMS, "cost_usd", "cache_savings_usd"])]
    for t in totals:
        lines.append(_csv_line([*(t.group[g] for g in group_by), *(getattr(t, n) for n in SUMS),
                                usd(t.cost_nusd), usd(t.savings_nusd)]))
    return "".join(lines)


def rows_csv_header() -> str:
    return _csv_line(ROW_COLUMNS)


def rows_csv(rows: Iterable[UsageRow]) -> str:
    return "".join(
        _csv_line([r.request_id, _stamp(r.created_at), r.tenant_id, r.api_key_id, r.model, r.status, r.prompt_tokens,
                   r.cached_tokens, r.completion_tokens, r.reasoning_tokens,
                   None if r.ttft_s is None else f"{r.ttft_s:.6f}", usd(r.cost_nusd), usd(r.savings_nusd)])
        for r in rows
    )

