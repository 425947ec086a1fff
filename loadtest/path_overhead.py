#!/usr/bin/env python
"""The request path's time outside the engines' forwards, measured apart (for sim_vs_live.py).

The simulator times the engines' forwards (the cost models ``crescent profile`` fits); a live
request also pays the gateway, the scheduler, gRPC, the handoff, SSE and sampling. This measures
that remainder on an idle server, never from the replay being checked (which would be circular):
it sends ``--requests`` prompts of the trace's own sizes (from another window and another block
text than the replay's, so nothing is cached from it) one at a time, ``--gap`` seconds apart, then
runs the same requests through the simulator alone and reports the median of live minus
simulated TTFT.

    python loadtest/path_overhead.py --url http://127.0.0.1:8000 --costs costs.yaml --mode pools --json overhead.json
    python loadtest/sim_vs_live.py --live live.json --costs costs.yaml --mode pools --path-overhead-from overhead.json

Take it right after starting the server (each request alone), before the replay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the checkout

from loadtest.replay.run import ReplayConfig, replay  # noqa: E402
from loadtest import sim_vs_live  # noqa: E402
from loadtest.sim_vs_live import InputError, replayed_requests  # noqa: E402
from loadtest.simulator.cost_file import load_cost_file  # noqa: E402
from loadtest.simulator.trace import DEFAULT_TRACE, load_trace  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--costs", type=Path, required=True, help="crescent profile --out file")
    p.add_argument("--mode", choices=("aggregated", "pools"), required=True)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--skip", type=int, default=200, help="the trace's requests to take sizes from start here")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--gap", type=float, default=3.0, help="seconds between requests (each runs alone)")
    p.add_argument("--tokens-per-block", type=int, default=16, help="as the replay's")
    p.add_argument("--output-scale", type=float, default=32.0, help="as the replay's")
    p.add_argument("--seed", type=int, default=7919, help="block text unlike the replay's (its default seed is 0)")
    p.add_argument("--json", type=Path, help="write the result here")
    return p.parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    costs = load_cost_file(args.costs)
    # The simulated engines as sim_vs_live.py sets them up by default: the live settings' defaults.
    setup = sim_vs_live.parse_args(["--live", "-", "--costs", str(args.costs), "--mode", args.mode])
    if args.mode == "aggregated" and costs.mixed is None:  # say so before the measuring, not after
        raise InputError(f"{args.costs} has no cost.mixed section: profile the aggregated mode")
    window = load_trace(args.trace, args.skip + args.requests)[args.skip:]
    if len(window) < args.requests:
        raise InputError(f"the trace has {len(window)} requests past --skip {args.skip}, not {args.requests}")
    spaced = [replace(r, arrival_s=i * args.gap) for i, r in enumerate(window)]
    cfg = ReplayConfig(url=args.url, tokens_per_block=args.tokens_per_block, output_scale=args.output_scale,
                       max_requests=None, max_seconds=args.requests * args.gap + 300, seed=args.seed)
    report = asyncio.run(replay(cfg, spaced))
    requests, live, _ = replayed_requests(report["per_request"])
    simulated = sim_vs_live.simulate(setup, costs, requests)
    rows = [{"index": r.index, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
             "live_s": live[r.index], "simulated_s": simulated[r.index], "difference_s": live[r.index] - simulated[r.index]}
            for r in requests if r.index in live]
    diffs = sorted(row["difference_s"] for row in rows)
    quartiles = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [diffs[0]] * 3
    return {"mode": args.mode, "url": args.url, "requests": len(rows), "failed": report["failed"],
            "path_overhead_s": statistics.median(diffs), "quartiles_s": [quartiles[0], quartiles[2]], "per_request": rows}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = measure(args)
    except (InputError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for row in result["per_request"]:
        print(f"request {row['index']}: {row['prompt_tokens']} prompt tokens ({row['cached_tokens']} cached), "
              f"live {row['live_s']:.3f} s, simulated {row['simulated_s']:.3f} s, difference {row['difference_s']:+.3f} s")
    q1, q3 = result["quartiles_s"]
    print(f"path overhead ({result['mode']}): median {result['path_overhead_s']:.3f} s "
          f"(quartiles {q1:.3f} / {q3:.3f} s) over {result['requests']} requests, {result['failed']} failed")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
