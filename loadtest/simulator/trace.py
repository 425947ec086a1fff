"""Mooncake-format traces: one JSON object per line with timestamp (ms), input_length,
output_length and hash_ids (one id per 512-token block, naming the block and its prefix)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

# The FAST'25 synthetic trace lives beside the checkout (../shared/traces); CRESCENT_TRACE overrides.
DEFAULT_TRACE = Path(
    os.environ.get("CRESCENT_TRACE")
    or Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "synthetic_trace.jsonl"
)
TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that does not follow the format; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path = DEFAULT_TRACE, limit: int | None = None) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                req = TraceRequest(
                    index=len(requests),
                    arrival_s=float(row["timestamp"]) / 1000.0,
                    input_length=int(row["input_length"]),
                    output_length=max(int(row["output_length"]), 1),
                    hash_ids=tuple(int(h) for h in row["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: {exc!r}") from None
            if req.input_length <= 0:
                raise TraceError(f"{path}:{lineno}: input_length must be positive")
            requests.append(req)
    return requests


def rescale(requests: Sequence[TraceRequest], time_scale: float) -> list[TraceRequest]:
    """Stretch (>1) or compress (<1) arrival times: compressing raises the offered load."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be positive, got {time_scale}")
    return [replace(r, arrival_s=r.arrival_s * time_scale) for r in requests]
