#!/usr/bin/env python
"""Each fault once, under streaming load, against a fresh ``crescent up``; prints a table.

For every fault: what the clients saw (streams completed, with the reference text, migrations,
error events, broken connections, 503s of new requests), the recovery time (seconds from the
signal until the service runs again, every service answers /health, the gateway sees every
engine and a request succeeds), the worst stall between two chunks after the fault, and how
soon decode freed the KV of requests nobody reads any more.

  python loadtest/faults.py                         # every fault, a fresh stack each (~10 min on 2 cores)
  python loadtest/faults.py --only decode-kill gateway-kill --shared-stack
  python loadtest/faults.py --json out.json         # the table's figures as JSON too

The scenarios are the fault suite's (tests/faults/), so the figures are what the tests assert on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.faults

from tests.faults.kv_scenarios import (  # noqa: E402
    OVERLOAD_REQUESTS,
    OverloadOutcome,
    clients_gone,
    gateway_killed,
    overload,
)
from tests.faults.load import LoadClient, story_prompts  # noqa: E402
from tests.faults.scenarios import (  # noqa: E402
    STREAMS,
    FaultOutcome,
    prefill_fault,
    scheduler_outage,
    streams_under_fault,
)
from tests.faults.stack import FaultStack, StackPlan  # noqa: E402

log = logging.getLogger("faults")

Scenario = Callable[[FaultStack, LoadClient], Awaitable[FaultOutcome | OverloadOutcome]]
PROMPTS = story_prompts(STREAMS + 2)
SMALL_KV = StackPlan(kv_capacity_tokens=2048)


def _streams(fault: str, target: str | None, sig: signal.Signals, *, late: bool = False, role: str = "",
             watch: bool = False) -> Scenario:
    return lambda stack, client: streams_under_fault(
        stack, client, fault, target, sig, role=role, prompts=PROMPTS[:STREAMS],
        late_prompts=PROMPTS[STREAMS:] if late else (), watch_target_health=watch)


FAULTS: dict[str, tuple[Scenario, StackPlan]] = {
    "kvstore-kill": (_streams("kvstore SIGKILL", "kvstore", signal.SIGKILL, late=True), StackPlan()),
    "kvstore-term": (_streams("kvstore SIGTERM", "kvstore", signal.SIGTERM, late=True), StackPlan()),
    "scheduler-kill": (lambda s, c: scheduler_outage(s, c, signal.SIGKILL), StackPlan()),
    "scheduler-term": (lambda s, c: scheduler_outage(s, c, signal.SIGTERM), StackPlan()),
    "prefill-kill": (lambda s, c: prefill_fault(s, c, signal.SIGKILL), StackPlan()),
    "prefill-term": (lambda s, c: prefill_fault(s, c, signal.SIGTERM), StackPlan()),
    "decode-kill": (_streams("decode SIGKILL", None, signal.SIGKILL, role="decode"), StackPlan()),
    "decode-term": (_streams("decode SIGTERM", None, signal.SIGTERM, role="decode", late=True, watch=True),
                    StackPlan()),
    "gateway-term": (_streams("gateway SIGTERM", "gateway", signal.SIGTERM, watch=True), StackPlan()),
    "gateway-kill": (gateway_killed, StackPlan()),
    "disconnect-mid-stream": (lambda s, c: clients_gone(s, c, before_first_token=False), StackPlan()),
    "disconnect-before-first-token": (lambda s, c: clients_gone(s, c, before_first_token=True), StackPlan()),
    "small-kv-overload": (overload, SMALL_KV),
    "small-kv-overload-slo-10s": (lambda s, c: overload(s, c, sequential=0),
                                  StackPlan(kv_capacity_tokens=2048, extra_args=("--ttft-slo", "10"))),
}


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def client_saw(outcome: FaultOutcome) -> str:
    streams = outcome.streams
    if outcome.target == "client":
        return f"{sum(r.transport_error == 'the client hung up' for r in streams)}/{len(streams)} streams hung up"
    completed = sum(r.completed for r in streams)
    parts = [f"{completed}/{len(streams)} completed"]
    if outcome.references:
        parts.append(f"{completed - len(outcome.mismatched())} = reference")
    if outcome.migrations:
        parts.append(f"{outcome.migrations:.0f} re-placements")
    errors = sum(r.error_event for r in streams)
    broken = sum(r.transport_error is not None and r.transport_error != "the client hung up" for r in streams)
    parts += [f"{errors} error events"] + ([f"{broken} connections broken"] if broken else [])
    if outcome.probes:
        refused = sum(p.status == 503 for p in outcome.probes)
        ok = sum(p.completed for p in outcome.probes)
        other = len(outcome.probes) - refused - ok
        parts.append(f"new requests: {refused}× 503+Retry-After, {ok}× 200" + (f", {other}× other" if other else ""))
        parts.append("gateway /health " + ("200 throughout" if set(outcome.gateway_health) == {200}
                                           else f"{sorted(set(map(str, outcome.gateway_health)))}"))
    return "; ".join(parts)


def row(name: str, outcome: FaultOutcome | OverloadOutcome) -> dict[str, str]:
    if isinstance(outcome, OverloadOutcome):
        conc, seq = outcome.statuses(outcome.concurrent), outcome.statuses(outcome.sequential)
        ttfts = [r.first_token_at - r.started for r in outcome.concurrent if r.first_token_at]
        saw = (f"{OVERLOAD_REQUESTS} concurrent: {dict(conc)}, {len(outcome.aborted_after_accept())} aborted after "
               f"accept, {len(outcome.untrue_429s(outcome.concurrent))} 429s without a true reason, slowest first "
               f"token {max(ttfts, default=0.0):.1f} s")
        if outcome.sequential:
            saw += f"; {len(outcome.sequential)} sequential max_tokens=1: {dict(seq)}"
        return {"fault": name, "client saw": saw, "recovery s": "—", "worst stall s": "—", "KV freed s": "—"}
    recovery = _seconds(outcome.recovery_s) if outcome.recovery_error is None else "did not recover"
    return {"fault": f"{outcome.fault} ({outcome.target})", "client saw": client_saw(outcome),
            "recovery s": recovery if outcome.target != "client" else "—",
            "worst stall s": _seconds(outcome.worst_stall_s()) if outcome.references else "—",
            "KV freed s": _seconds(outcome.kv_freed_s) + (
                f" (scheduler: {_seconds(outcome.scheduler_freed_s)})" if outcome.kv_freed_s is not None else "")}


async def run(names: list[str], shared: bool, work: Path) -> list[dict[str, str]]:
    rows = []
    shared_stack: FaultStack | None = None
    for name in names:
        scenario, plan = FAULTS[name]
        fresh = not shared or plan != StackPlan()
        log.info("%s: %s", name, "starting a fresh stack" if fresh else "on the shared stack")
        if fresh:
            stack = await asyncio.to_thread(FaultStack.start, work / name, plan)
        else:
            shared_stack = shared_stack or await asyncio.to_thread(FaultStack.start, work / "shared", plan)
            stack = shared_stack
        try:
            await asyncio.to_thread(stack.wait_healthy, 120)
            async with LoadClient(stack.url, stack.model) as client:
                outcome = await scenario(stack, client)
            rows.append(row(name, outcome))
        except Exception as exc:  # one fault going wrong still leaves the others' figures
            log.exception("%s failed", name)
            rows.append({"fault": name, "client saw": f"scenario failed: {exc}".splitlines()[0],
                         "recovery s": "—", "worst stall s": "—", "KV freed s": "—"})
        finally:
            if fresh:
                await asyncio.to_thread(stack.stop)
        log.info("%s", rows[-1])
    if shared_stack is not None:
        await asyncio.to_thread(shared_stack.stop)
    return rows


def machine() -> str:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name"))
    except (StopIteration, OSError):
        cpu = platform.processor() or "unknown CPU"
    return f"{cpu}, {os.cpu_count()} cores"


def markdown(rows: list[dict[str, str]]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(r[c] for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(FAULTS), help="run these faults only")
    parser.add_argument("--shared-stack", action="store_true", help="one stack for every fault (faster)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--keep", type=Path, help="run the stacks in this directory and keep their logs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        rows = asyncio.run(run(args.only or list(FAULTS), args.shared_stack, args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="crescent-faults-") as work:
            rows = asyncio.run(run(args.only or list(FAULTS), args.shared_stack, Path(work)))
    header = (f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {machine()}, "
              f"{time.monotonic() - started:.0f} s in all\n\n")
    sys.stdout.write(header + markdown(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
