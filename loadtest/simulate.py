"""Replay a Mooncake-format trace through the simulated cluster and compare policies.

    .venv/bin/python loadtest/simulate.py --policies random,least_loaded,cache_aware,kvcache_centric \
        --prefill 16 --decode 16 --colocated-baselines --plots out/sim

Prints a table (TTFT avg/p50/p90/p99, Mooncake TBT, effective request capacity, rejection
rate, hit rate, prefill compute) and the wall time of each run; writes PNG plots with --plots.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the checkout

from loadtest.simulator import SimConfig, load_trace, rescale, simulate, summarize  # noqa: E402
from loadtest.simulator.report import SimOutcome, Summary, render_table  # noqa: E402
from loadtest.simulator.trace import DEFAULT_TRACE  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--time-scale", type=float, default=1.0, help="<1 compresses arrivals (more load)")
    p.add_argument("--policies", default="random,least_loaded,cache_aware,kvcache_centric")
    p.add_argument("--prefill", type=int, default=16)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--cache-tokens", type=int, default=3_000_000, help="per prefill instance; 0: unbounded")
    p.add_argument("--per-node-cache", action="store_true", help="no pulls from peers' caches")
    p.add_argument("--colocated-baselines", action="store_true", help="add colocated runs with and without prefix caching")
    p.add_argument("--reject-early", action="store_true")
    p.add_argument("--slo-ttft", type=float, default=30.0)
    p.add_argument("--slo-tbt", type=float, default=0.1)
    p.add_argument("--chunk-tokens", type=int, default=8192)
    p.add_argument("--costs", type=Path, default=None,
                   help="cost models from `crescent profile --out` (default: the paper's LLaMA3-70B on 8xA800)")
    p.add_argument("--plots", type=Path, default=None, help="folder for PNG plots")
    p.add_argument("--json", action="store_true", help="one JSON line per run instead of a table")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trace = load_trace(args.trace, args.limit)
    costs = None
    if args.costs:
        from loadtest.simulator.cost_file import CostFileError, load_cost_file

        try:
            costs = load_cost_file(args.costs)
        except CostFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.time_scale != 1.0:
        trace = rescale(trace, args.time_scale)
    base = SimConfig(
        prefill_instances=args.prefill, decode_instances=args.decode,
        cache_capacity_tokens=args.cache_tokens or None, global_cache=not args.per_node_cache,
        reject_early=args.reject_early, slo_ttft_s=args.slo_ttft, slo_tbt_s=args.slo_tbt, chunk_tokens=args.chunk_tokens,
    )
    runs = [(name, replace(base, policy=name)) for name in args.policies.split(",") if name]
    if args.colocated_baselines:
        runs.append(("colocated+cache", replace(base, policy="cache_aware", colocated=True)))
        runs.append(("colocated", replace(base, policy="least_loaded", colocated=True, prefix_caching=False)))
    summaries: list[Summary] = []
    records: dict[str, list[SimOutcome]] = {}
    for label, config in runs:
        start = time.perf_counter()
        recs = simulate(trace, config, costs)
        elapsed = time.perf_counter() - start
        summary = summarize(label, recs, config.slo_ttft_s, config.slo_tbt_s)
        summaries.append(summary)
        records[label] = recs
        if args.json:
            print(json.dumps({**asdict(summary), "wall_s": round(elapsed, 2)}))
        else:
            print(f"{label}: {len(recs)} requests simulated in {elapsed:.1f} s", file=sys.stderr)
    if not args.json:
        print(render_table(summaries, f"{len(trace)} requests, {args.prefill} prefill + {args.decode} decode"))
    if args.plots:
        from loadtest.simulator.plots import plot_results

        for path in plot_results(summaries, records, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
