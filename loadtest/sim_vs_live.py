"""Simulated vs live TTFT: replay a live run's requests through the simulator and compare.

The simulator is what operators size a cluster with, so it must predict what the live system
does. This takes the per-request rows of a live replay (``python -m loadtest.replay --json``:
arrival, prompt tokens, cached tokens, output tokens, TTFT), runs the same requests through the
live setup's step plans (``loadtest/simulator/one_machine.py``) timed by the cost models
``crescent profile`` fitted on the same machine, and prints simulated vs live TTFT p50/p90/p99/
mean, the relative error of each and whether it is within the tolerance (25%).

    crescent profile --out costs.yaml
    python -m loadtest.replay --url http://127.0.0.1:8000 --max-requests 100 --rate 0.2 --json live.json
    python loadtest/sim_vs_live.py --live live.json --costs costs.yaml --mode aggregated

Which requests: those the live run admitted. A request refused (an HTTP error such as 429) never
ran and is not replayed; one cut off by the replay's time bound or the client's timeout did run:
it is replayed with its requested output, and, when the server never reported its usage, a prompt
of its words plus the chat template's tokens (the median difference over completed requests) and
nothing cached. TTFTs are compared over the requests completed live.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the checkout

from crescent.services.scheduler.cost_model import CostModels  # noqa: E402
from loadtest.replay.prompts import percentile  # noqa: E402
from loadtest.simulator.cost_file import load_cost_file  # noqa: E402
from loadtest.simulator.one_machine import (  # noqa: E402
    AggregatedSetup, PoolsSetup, ReplayedRequest, simulate_aggregated, simulate_pools,
)

STATS = ("p50", "p90", "p99", "mean")
RAN_UNFINISHED = ("timeout", "unfinished")  # statuses of requests that ran but were cut off


class InputError(ValueError):
    """A live report or cost file this script cannot use; the message says what to change."""


def load_live(path: Path, run: int | None) -> dict:
    """One replay report; a sweep's file holds several, ``run`` picks one."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read the live report: {exc}") from None
    if isinstance(doc, list):
        if run is None or not 0 <= run < len(doc):
            raise InputError(f"{path} holds {len(doc)} runs (a sweep): pick one with --run 0..{len(doc) - 1}")
        doc = doc[run]
    if not isinstance(doc, dict) or not isinstance(doc.get("per_request"), list):
        raise InputError(f"{path}: no per_request rows; write the report with `python -m loadtest.replay --json`")
    return doc


def replayed_requests(rows: Sequence[dict]) -> tuple[list[ReplayedRequest], dict[int, float], int]:
    """(requests to simulate, live TTFT by index of those completed, how many were refused live)."""
    need = ("index", "arrival_s", "ok", "status", "ttft_s", "output_tokens", "prompt_tokens", "cached_tokens")
    for i, row in enumerate(rows):
        missing = [k for k in need if k not in row]
        if missing:
            raise InputError(f"per_request row {i} lacks {', '.join(missing)}")
    done = [r for r in rows if r["ok"]]
    if not done:
        raise InputError("no request completed in the live run: nothing to compare")
    template = [r["prompt_tokens"] - r["prompt_words"] for r in done if r.get("prompt_words") and r["prompt_tokens"]]
    requests, live, refused = [], {}, 0
    for row in rows:
        if row["ok"]:
            live[row["index"]] = float(row["ttft_s"])
            prompt, cached, output = row["prompt_tokens"], row["cached_tokens"] or 0, row["output_tokens"]
        elif row["status"] in RAN_UNFINISHED:
            prompt, cached, output = row["prompt_tokens"], row["cached_tokens"] or 0, row.get("max_tokens") or 1
        else:
            refused += 1
            continue
        if not prompt:  # cut off before the server reported its usage (or it reports none)
            if not row.get("prompt_words") or not template:
                raise InputError(f"request {row['index']} has no prompt size: the server reported no usage, and "
                                 "rows without prompt_words come from an older loadtest.replay")
            prompt, cached = row["prompt_words"] + round(statistics.median(template)), 0
        requests.append(ReplayedRequest(row["index"], float(row["arrival_s"]), int(prompt), int(cached), max(int(output), 1)))
    return requests, live, refused


def path_overhead_from(path: Path, mode: str) -> float:
    """The median path overhead that loadtest/path_overhead.py measured for ``mode``."""
    try:
        doc = json.loads(path.read_text())
        measured, seconds = doc["mode"], float(doc["path_overhead_s"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{path}: not a loadtest/path_overhead.py --json result ({exc})") from None
    if measured != mode:
        raise InputError(f"{path} measured the {measured} mode's path, not {mode}'s")
    return seconds


def compare(simulated: dict[int, float], live: dict[int, float], overhead_s: float, tolerance: float) -> dict:
    """TTFT statistics of both over the requests completed live, relative errors, verdicts."""
    ids = sorted(live)
    sims = [simulated[i] + overhead_s for i in ids]
    lives = [live[i] for i in ids]

    def stats(xs: list[float]) -> dict[str, float]:
        return {f"p{p}": percentile(xs, p) for p in (50, 90, 99)} | {"mean": sum(xs) / len(xs)}

    sim_stats, live_stats = stats(sims), stats(lives)
    error = {k: (sim_stats[k] - live_stats[k]) / live_stats[k] if live_stats[k] else float("inf") for k in STATS}
    within = {k: abs(error[k]) <= tolerance for k in STATS}
    # Where they disagree most, request by request: what to look at when the totals do not agree.
    worst = sorted(((i, s, l) for i, s, l in zip(ids, sims, lives)), key=lambda t: -abs(t[1] - t[2]))[:5]
    return {"requests": len(ids), "simulated": sim_stats, "live": live_stats, "relative_error": error,
            "within": within, "all_within": all(within.values()), "tolerance": tolerance,
            "largest_differences": [{"index": i, "simulated_s": s, "live_s": l} for i, s, l in worst]}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    aggregated, pools = AggregatedSetup(), PoolsSetup()  # the live engines' defaults
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--live", type=Path, required=True, help="python -m loadtest.replay --json report")
    p.add_argument("--run", type=int, help="which run of a sweep's report (0-based)")
    p.add_argument("--costs", type=Path, required=True, help="crescent profile --out file (cost: section)")
    p.add_argument("--mode", choices=("aggregated", "pools"), default="aggregated",
                   help="how the live server ran: crescent up --aggregated 1 or 0")
    p.add_argument("--chunk-tokens", type=int, default=aggregated.chunk_tokens, help="aggregated: chunk_tokens")
    p.add_argument("--block-size", type=int, default=aggregated.block_size, help="engine.block_size")
    p.add_argument("--max-batch", type=int, default=aggregated.max_batch, help="engine.max_batch_size (decode)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=pools.prefill_chunk_tokens,
                   help="pools: engine.prefill_chunk_tokens")
    p.add_argument("--max-batch-tokens", type=int, default=pools.max_batch_tokens, help="pools: prefill's max_batch_tokens")
    p.add_argument("--path-overhead-s", type=float, default=0.0,
                   help="added to every simulated TTFT: the gateway's and gRPC's time, which the cost models leave out")
    p.add_argument("--path-overhead-from", type=Path,
                   help="take --path-overhead-s from loadtest/path_overhead.py --json (measured apart, same mode)")
    p.add_argument("--tolerance", type=float, default=0.25, help="largest relative error that agrees")
    p.add_argument("--json", type=Path, help="write the comparison here")
    return p.parse_args(argv)


def simulate(args: argparse.Namespace, costs: CostModels, requests: list[ReplayedRequest]) -> dict[int, float]:
    if args.mode == "pools":
        return simulate_pools(requests, costs, PoolsSetup(args.prefill_chunk_tokens, args.max_batch_tokens, args.max_batch))
    if costs.mixed is None:
        raise InputError(f"{args.costs} has no cost.mixed section: profile the aggregated mode "
                         "(`crescent profile --mode aggregated` or `--mode both`)")
    return simulate_aggregated(requests, costs.mixed, AggregatedSetup(args.chunk_tokens, args.block_size, args.max_batch))


def render(result: dict, title: str) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for col in ("TTFT", "simulated s", "live s", "error", f"within {result['tolerance']:.0%}"):
        table.add_column(col, justify="left" if col == "TTFT" else "right")
    for k in STATS:
        table.add_row(k, f"{result['simulated'][k]:.3f}", f"{result['live'][k]:.3f}",
                      f"{result['relative_error'][k]:+.0%}", "yes" if result["within"][k] else "NO")
    console = Console(record=True, width=100)
    with console.capture() as capture:
        console.print(title)
        console.print(table)
    return capture.get()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = load_live(args.live, args.run)
        costs = load_cost_file(args.costs)
        if args.path_overhead_from:
            args.path_overhead_s = path_overhead_from(args.path_overhead_from, args.mode)
        requests, live, refused = replayed_requests(report["per_request"])
        result = compare(simulate(args, costs, requests), live, args.path_overhead_s, args.tolerance)
    except (InputError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result |= {"mode": args.mode, "path_overhead_s": args.path_overhead_s, "replayed": len(requests), "refused_live": refused}
    title = (f"{args.mode}: {result['requests']} requests completed live ({len(requests)} replayed, "
             f"{refused} refused live)")
    print(render(result, title), end="")
    print("largest differences (request: simulated / live s): "
          + ", ".join(f"{d['index']}: {d['simulated_s']:.2f} / {d['live_s']:.2f}" for d in result["largest_differences"]))
    verdict = "within" if result["all_within"] else "NOT within"
    print(f"simulated TTFT {verdict} {args.tolerance:.0%} of live on every statistic")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
