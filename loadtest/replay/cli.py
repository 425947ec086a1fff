"""The command line: one run or a sweep, rich tables, the JSON report and the sweep's PNG."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from loadtest.replay.run import ReplayConfig, replay
from loadtest.simulator.trace import DEFAULT_TRACE, load_trace

DESCRIPTION = "Live, open-loop replay of a Mooncake-format trace against any OpenAI-compatible server."


def _f(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=100)
    t = Table(title=f"replay {report['url']} ({report['model']}, time scale {report['time_scale']:g})", show_header=False)
    t.add_row("requests / completed / failed", f"{report['requests']} / {report['completed']} / {report['failed']}")
    t.add_row("offered load", f"{_f(report['offered_rps'], '.3f')} req/s over {report['wall_s']:.0f} s wall")
    for k, v in sorted(report["rejections"].items()):
        t.add_row(f"  failed: {k}", str(v))
    for name in ("ttft_s", "tbt_s"):
        d = report[name]
        t.add_row(name.replace("_s", " (s)") + " p50/p90/p99/mean", " / ".join(_f(d[k]) for k in ("p50", "p90", "p99", "mean")))
    t.add_row(f"TTFT ≤ {report['ttft_slo_s']:g} s / TBT ≤ {report['tbt_slo_s']:g} s",
              f"{_f(report['ttft_attainment'], '.0%')} / {_f(report['tbt_attainment'], '.0%')}")
    t.add_row("effective request capacity", _f(report["effective_capacity"], ".0%"))
    th = report["theoretical_cached_fraction"]
    t.add_row("cached fraction (server / trace max)",
              f"{_f(report['cached_fraction'], '.1%')} / {th['blocks']:.1%} of blocks, {th['tokens']:.1%} of tokens")
    console.print(t)


def plot_sweep(rows: Sequence[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in dict.fromkeys(r["target"] for r in rows):
        pts = sorted((r["offered_rps"] or 0.0, r["effective_capacity"] or 0.0) for r in rows if r["target"] == name)
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("effective request capacity (% meeting both SLOs)")
    r0 = rows[0]
    ax.set_title(f"goodput vs load (TTFT ≤ {r0['ttft_slo_s']:g} s, TBT ≤ {r0['tbt_slo_s']:g} s)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rate_capacity(rows: Sequence[dict], share: float = 0.9) -> tuple[float | None, bool]:
    """Mooncake's effective request capacity of one target's sweep: the highest offered rate at
    which ``share`` of the requests meet both SLOs, interpolated between the levels around the
    crossing. (None, False): even the lowest level fell short; (highest rate, True): no level
    did, so the capacity is at least that."""
    pts = sorted((r["offered_rps"] or 0.0, r["effective_capacity"] or 0.0) for r in rows)
    for i, (rate, kept) in enumerate(pts):
        if kept < share:
            if i == 0:
                return None, False
            (r0, k0), (r1, k1) = pts[i - 1], (rate, kept)
            return r0 + (k0 - share) / (k0 - k1) * (r1 - r0), False
    return pts[-1][0], True


# ---------------------------------------------------------------- command line
def machine() -> dict:
    info = {"host": platform.node(), "python": platform.python_version(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                info["avx512f"] = "avx512f" in flags
                break
    except OSError:
        pass
    return info


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (…/v1 is appended)")
    p.add_argument("--model", help="model name to send (default: the server's first /v1/models entry)")
    p.add_argument("--api", choices=("chat", "completions"), default="chat")
    p.add_argument("--tokens-per-block", type=int, default=16, help="words per 512-token trace block")
    p.add_argument("--output-scale", type=float, default=32.0, help="divide output lengths by this")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (< 1: more load)")
    p.add_argument("--rate", type=float, help="target request rate (req/s); overrides --time-scale")
    p.add_argument("--max-requests", type=int, default=100)
    p.add_argument("--skip", type=int, default=0,
                   help="start at this request of the trace (a window where turns share prefixes: 3800 of the shared one)")
    p.add_argument("--max-seconds", type=float, default=600.0, help="bound on a run; in-flight requests are then cut off")
    p.add_argument("--ttft-slo", type=float, default=10.0, help="seconds")
    p.add_argument("--tbt-slo", type=float, default=1.0, help="seconds (Mooncake TBT)")
    p.add_argument("--seed", type=int, default=0, help="block-text seed; change it to replay on a cold prefix cache")
    p.add_argument("--json", type=Path, help="write the report(s) here")
    p.add_argument("--sweep", action="store_true", help="several load levels against every --target")
    p.add_argument("--target", action="append", default=[], metavar="NAME=URL", help="a server for --sweep (repeatable)")
    p.add_argument("--time-scales", default="1,0.5,0.25", help="--sweep load levels (comma-separated time scales)")
    p.add_argument("--rates", help="--sweep load levels as request rates (req/s, comma-separated); overrides --time-scales")
    p.add_argument("--label", default="server", help="--sweep target name when only --url is given")
    p.add_argument("--plot-from", type=Path, nargs="+", help="tabulate and plot the rows of earlier --sweep --json files")
    p.add_argument("--png", type=Path, default=Path("replay_sweep.png"), help="--sweep plot")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace, url: str, time_scale: float, seed: int, rate: float | None) -> ReplayConfig:
    return ReplayConfig(
        url=url, model=args.model, api=args.api, tokens_per_block=args.tokens_per_block, output_scale=args.output_scale,
        time_scale=time_scale, rate=rate, max_requests=args.max_requests, max_seconds=args.max_seconds,
        ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo, seed=seed,
    )


async def amain(args: argparse.Namespace) -> list[dict]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if args.skip < 0:
        raise SystemExit("--skip must be >= 0")
    trace = load_trace(args.trace, args.skip + args.max_requests)[args.skip:]
    if not trace:
        raise SystemExit(f"--skip {args.skip}: the trace has no requests past that")
    reports: list[dict] = []

    def progress() -> Progress:
        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)

    if args.plot_from:  # rows of earlier sweeps (e.g. one server at a time), plotted together
        reports = [row for f in args.plot_from for row in json.loads(f.read_text())]
    elif not args.sweep:
        with progress() as bar:
            report = await replay(config_from(args, args.url, args.time_scale, args.seed, args.rate), trace, bar)
        report |= {"machine": machine(), "trace_skip": args.skip}
        print_report(report)
        reports.append(report)
    else:
        targets = [t.split("=", 1) if "=" in t else (t, t) for t in args.target] or [(args.label, args.url)]
        # Load levels: request rates (--rates) or time scales (--time-scales).
        if args.rates:
            levels = [(1.0, float(r)) for r in args.rates.split(",") if r.strip()]
        else:
            levels = [(float(s), None) for s in args.time_scales.split(",") if s.strip()]
        # Load levels outermost, servers alternating within a level; each level gets its own block
        # text (seed + level) so one level's prefixes do not warm the next level's cache.
        for level, (scale, rate) in enumerate(levels):
            for name, url in targets:
                with progress() as bar:
                    report = await replay(config_from(args, url, scale, args.seed + level, rate), trace, bar)
                report |= {"target": name, "machine": machine(), "trace_skip": args.skip}
                reports.append(report)
                console.print(f"{name} level {level}: {report['completed']}/{report['requests']} completed, "
                              f"effective capacity {_f(report['effective_capacity'], '.0%')}")
    if args.sweep or args.plot_from:
        from rich.table import Table

        t = Table(title="sweep")
        for col in ("target", "time scale", "offered req/s", "completed", "failed", "TTFT p50/p90", "TBT p90", "eff. capacity", "cached / max"):
            t.add_column(col)
        for r in reports:
            t.add_row(r["target"], f"{r['time_scale']:g}", _f(r["offered_rps"], ".3f"), str(r["completed"]), str(r["failed"]),
                      f"{_f(r['ttft_s']['p50'])} / {_f(r['ttft_s']['p90'])}", _f(r["tbt_s"]["p90"]),
                      _f(r["effective_capacity"], ".0%"), f"{_f(r['cached_fraction'], '.0%')} / {r['theoretical_cached_fraction']['tokens']:.0%}")
        Console(width=160).print(t)
        for name in dict.fromkeys(r["target"] for r in reports):
            rate, at_least = rate_capacity([r for r in reports if r["target"] == name])
            said = ("below the lowest level" if rate is None else f"{'at least ' if at_least else ''}{rate:.2f} req/s")
            Console().print(f"{name}: effective request capacity (90% within both SLOs) {said}")
        plot_sweep(reports, args.png)
        console.print(f"plot: {args.png}")
    if args.json:
        args.json.write_text(json.dumps(reports if args.sweep or args.plot_from else reports[0], indent=2))
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    asyncio.run(amain(parse_args(argv)))
    return 0
