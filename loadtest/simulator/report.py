"""Per-request outcomes and the figures the simulator reports: TTFT percentiles, Mooncake TBT,
effective request capacity, rejection rate, cache hit rate, prefill compute."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.simulator.nodes import SimRequest


@dataclass(frozen=True, slots=True)
class SimOutcome:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    total_blocks: int
    reused_blocks: int
    computed_tokens: int
    ttft_s: float | None        # None: rejected
    tbt_s: float | None
    rejection: str = ""
    prefill: str = ""
    decode: str = ""

    @staticmethod
    def rejected(req: SimRequest, reason: str) -> SimOutcome:
        return SimOutcome(req.index, req.arrival_s, req.input_length, req.output_length, len(req.keys), 0, 0,
                             None, None, reason)

    @staticmethod
    def completed(req: SimRequest) -> SimOutcome:
        assert req.first_token_s is not None
        return SimOutcome(
            req.index, req.arrival_s, req.input_length, req.output_length, len(req.keys), req.reused_blocks,
            req.computed_tokens, req.first_token_s - req.arrival_s, req.tbt_s, "", req.prefill, req.decode,
        )


@dataclass(frozen=True, slots=True)
class Summary:
    label: str
    requests: int
    admitted: int
    rejection_rate: float
    ttft_avg: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tbt_avg: float
    tbt_p90: float
    ttft_slo_met: float          # share of admitted requests within the TTFT SLO
    effective_capacity: float    # share of all requests within both SLOs
    hit_rate: float              # reused blocks / prompt blocks of admitted requests
    prefill_tokens: int          # prompt tokens computed

    def row(self) -> list[str]:
        return [
            self.label, f"{self.requests}", f"{self.rejection_rate:.1%}", f"{self.ttft_avg:.2f}", f"{self.ttft_p50:.2f}",
            f"{self.ttft_p90:.2f}", f"{self.ttft_p99:.2f}", f"{self.tbt_avg * 1000:.1f}", f"{self.tbt_p90 * 1000:.1f}",
            f"{self.effective_capacity:.1%}", f"{self.hit_rate:.1%}", f"{self.prefill_tokens / 1e6:.2f}",
        ]


COLUMNS = ["run", "requests", "rejected", "TTFT avg s", "p50", "p90", "p99", "TBT avg ms", "TBT p90 ms",
           "effective", "hit rate", "prefill Mtok"]


def summarize(label: str, records: Sequence[SimOutcome], slo_ttft_s: float, slo_tbt_s: float) -> Summary:
    done = [r for r in records if r.ttft_s is not None]
    ttft = np.array([r.ttft_s for r in done], dtype=float) if done else np.zeros(1)
    tbt = np.array([r.tbt_s or 0.0 for r in done], dtype=float) if done else np.zeros(1)
    within_ttft = ttft <= slo_ttft_s
    effective = int(np.count_nonzero(within_ttft & (tbt <= slo_tbt_s))) if done else 0
    blocks = sum(r.total_blocks for r in done)
    n = len(records)
    return Summary(
        label=label,
        requests=n,
        admitted=len(done),
        rejection_rate=(n - len(done)) / n if n else 0.0,
        ttft_avg=float(ttft.mean()),
        ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p90=float(np.percentile(ttft, 90)),
        ttft_p99=float(np.percentile(ttft, 99)),
        tbt_avg=float(tbt.mean()),
        tbt_p90=float(np.percentile(tbt, 90)),
        ttft_slo_met=float(within_ttft.mean()) if done else 0.0,
        effective_capacity=effective / n if n else 0.0,
        hit_rate=sum(r.reused_blocks for r in done) / blocks if blocks else 0.0,
        prefill_tokens=sum(r.computed_tokens for r in done),
    )


def render_table(summaries: Sequence[Summary], title: str = "simulation") -> str:
    """A rich table as text (the CLI prints it)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "run" else "right")
    for s in summaries:
        table.add_row(*s.row())
    console = Console(record=True, width=160)
    with console.capture() as capture:
        console.print(table)
    return capture.get()
