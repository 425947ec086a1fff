#!/usr/bin/env python
"""Crescent over vLLM against standalone vLLM: same weights, one engine process each, same run.

The vLLM engine backend's acceptance figures (`crescent up --engine vllm`): Crescent's goodput is
at least vLLM's at every load level, and what Crescent adds to a request's path at light load
(the gateway's tokenization and chat template, the scheduler's placement, the gRPC hops to the
instance, the KV connector's kvstore lookups and saves) stays under 10%.

For each target in order, one server at a time, each freshly started (cold caches) and stopped
before the next one starts:

- ``crescent``: ``crescent up --engine vllm --no-tls`` on a free port with its own ``--run-dir``
  (gateway, scheduler, kvstore and one aggregated instance whose engine is vLLM's CPU build with
  Crescent's KV connector); ready when the gateway's /health answers 200 and a completion succeeds.
- ``crescent-pools`` (not run by default): the same with ``--aggregated 0``, one vLLM prefill and
  one vLLM decode instance, each prompt handed from one to the other through the kvstore (two
  engine processes sharing the cores, against one for the others).
- ``vllm``: vLLM's own OpenAI server on the float32 Hugging Face directory Crescent's loader
  exported (the very weights Crescent's instance loads), ``--block-size 64 --max-model-len 8192
  --enable-prompt-tokens-details --disable-log-stats``; by default with the OpenMP settings Crescent's launcher gives
  its engine on this machine (``OMP_NUM_THREADS``, ``VLLM_CPU_OMP_THREADS_BIND=nobind``).

Against each:

1. light-load path overhead: ``--requests`` sequential streamed chat completions (after one
   warm-up request, not counted) alternating a ~``--short-tokens`` and a ~``--long-tokens``
   prompt, each new (a cold prefill on both servers), ``--max-tokens`` output tokens with
   ``ignore_eos``; then ``--warm`` of those prompts again (prefix-cache hits). Per request: TTFT
   and the mean time between streamed tokens; reported: their medians.
2. the live trace replay (``loadtest.replay``) at each of ``--rates`` over the shared synthetic
   trace's first ``--max-requests`` requests, each level on its own block text (seed + level):
   effective request capacity = the share of all sent requests meeting TTFT <= ``--ttft-slo`` and
   TBT <= ``--tbt-slo`` (Mooncake TBT).

Prints a table per target, then the crescent/vllm ratios of the light-load medians (target < 1.10)
and goodput per level side by side (target: crescent >= vllm). ``--json`` keeps everything,
with the machine (``lscpu`` model, cores, AVX flags), date and load average at start and end.
Ctrl-C (or SIGTERM) stops the server it started, and every process under it, before exiting.

  .venv/bin/python loadtest/bench_vllm_backend.py --json bench_vllm_backend.json
  .venv/bin/python loadtest/bench_vllm_backend.py --requests 3 --rates 0.2 --max-requests 6   # smoke
  .venv/bin/python loadtest/bench_vllm_backend.py --targets vllm --rates 0.1,0.2        # one target, other levels
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from crescent.services.common.ports import unused_port  # noqa: E402
from loadtest.replay.cli import rate_capacity  # noqa: E402
from loadtest.replay.prompts import WORDS  # noqa: E402
from loadtest.replay.run import ReplayConfig, replay  # noqa: E402
from loadtest.simulator.trace import DEFAULT_TRACE, load_trace  # noqa: E402

MODEL = "smollm2-135m-instruct"
TARGETS = ("crescent", "crescent-pools", "vllm")
DEFAULT_TARGETS = ("crescent", "vllm")
OVERHEAD_TARGET = 1.10
console = Console(width=150)
err = Console(stderr=True)


# ---------------------------------------------------------------- the machine
def lscpu() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    flags = set(fields.get("Flags", "").split())
    info["model_name"] = fields.get("Model name")
    info["cpus"] = fields.get("CPU(s)")
    info["threads_per_core"] = fields.get("Thread(s) per core")
    info["affinity_cores"] = len(os.sched_getaffinity(0))
    info["simd"] = sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    info["avx2"] = "avx2" in flags
    info["avx512f"] = "avx512f" in flags
    info["avx512_bf16"] = "avx512_bf16" in flags
    info["amx"] = any(f.startswith("amx") for f in flags)
    return info


def git_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty_files": len(git("status", "--porcelain").splitlines())}


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def now_utc() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def free_port() -> int:
    return unused_port()


# ---------------------------------------------------------------- processes
def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, from /proc."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = data[data.rfind(")") + 2:].split()  # the name may hold spaces and parentheses
    return int(rest[1]), int(rest[19])


def descendants(root: int) -> set[tuple[int, int]]:
    """Every live process under ``root`` as (pid, start time): the start time tells a reused pid."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st:
                children.setdefault(st[0], []).append((int(entry), st[1]))
    found: set[tuple[int, int]] = set()
    todo = [root]
    while todo:
        for kid in children.get(todo.pop(), ()):
            if kid not in found:
                found.add(kid)
                todo.append(kid[0])
    return found


def alive(proc: tuple[int, int]) -> bool:
    st = _stat(proc[0])
    return st is not None and st[1] == proc[1]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


def _die_with_parent() -> None:
    """In the server's process: SIGTERM when this script dies, however it dies (Linux prctl)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path
    seen: set[tuple[int, int]] = field(default_factory=set)
    started: float = field(default_factory=time.perf_counter)
    ready_s: float | None = None
    stop_s: float | None = None
    left_after_stop: int = 0
    left_names: list[str] = field(default_factory=list)
    # How to stop it: each signal, then how long to wait for the exit. `crescent up` drains on
    # SIGINT (in-flight requests get up to 30 s) and stops at once on a second one; vLLM's server
    # stops on SIGINT, though only once it is back in Python (seconds to a minute while compiling).
    ladder: tuple[tuple[signal.Signals, float], ...] = ((signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 10))

    def track(self) -> None:
        self.seen |= descendants(self.proc.pid)

    def stop(self) -> None:
        """SIGINT (both servers drain and stop on it), then harder; then any process seen under it."""
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        t0 = time.perf_counter()
        try:
            if self.proc.poll() is None:
                self.track()
                for sig, wait in self.ladder:
                    try:
                        self.proc.send_signal(sig)
                    except ProcessLookupError:
                        break
                    try:
                        self.proc.wait(timeout=wait)
                        break
                    except subprocess.TimeoutExpired:
                        err.print(f"[yellow]{self.name}: still running {wait} s after {sig.name}[/]")
            deadline = time.time() + 15  # children the leader told to stop may take a moment
            while time.time() < deadline and any(alive(p) for p in self.seen):
                time.sleep(0.5)
            left = [p for p in self.seen if alive(p)]
            self.left_after_stop = len(left)
            self.left_names = [f"{pid} {cmdline(pid)}" for pid, _ in left]
            if left:
                err.print(f"[red]{self.name}: {len(left)} process(es) left 15 s after the server exited; killing them:[/]")
                for line in self.left_names:
                    err.print(f"  {line}", markup=False, highlight=False)
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    for pid, _ in (p for p in left if alive(p)):
                        try:
                            os.kill(pid, sig)
                        except ProcessLookupError:
                            pass
                    time.sleep(5)
                still = [p for p in left if alive(p)]
                if still:
                    err.print(f"[red]{self.name}: could not end pids {[p[0] for p in still]}[/]")
        finally:
            self.stop_s = time.perf_counter() - t0
            signal.signal(signal.SIGINT, old)


def start_crescent(args: argparse.Namespace, run_dir: Path, name: str = "crescent") -> Server:
    port = free_port()
    crescent_dir = run_dir / name
    crescent_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / f"{name}-up.log"
    cmd = [sys.executable, "-m", "crescent.services.cli", "up", "--engine", "vllm", "--no-tls", "--port", str(port),
           "--run-dir", str(crescent_dir), "--ready-timeout", str(args.ready_timeout)]
    if name == "crescent-pools":  # one vLLM prefill and one vLLM decode, the prompt handed over through the kvstore
        cmd += ["--aggregated", "0"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent,
                                env={**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"})
    return Server(name, f"http://127.0.0.1:{port}", proc, log,
                  ladder=((signal.SIGINT, 90), (signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 10)))


def peer_env(args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gb:g}",
           "VLLM_CACHE_ROOT": str(args.peer_cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(args.peer_cache / "inductor"),
           "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1"}
    if args.peer_omp == "crescent":
        # What Crescent's launcher gives its one aggregated engine (services/cpu_share.py,
        # services/engine_vllm/engine.py): up to 2 OpenMP threads, vLLM's own core binding off.
        from crescent.services.cpu_share import available_cores, share_cores

        threads = share_cores(available_cores(), args.peer_dp)  # as Crescent shares cores among that many engines
        env.update(threads.env("aggregated"))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def start_vllm(args: argparse.Namespace, run_dir: Path) -> Server:
    from crescent.services.engine_vllm.model_dir import vllm_model

    model_dir = args.model_dir or vllm_model(MODEL).directory  # exported by Crescent's loader if missing
    port = free_port()
    log = run_dir / "vllm.log"
    cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", MODEL, "--dtype", "float32", "--block-size", "64", "--max-model-len", "8192",
           "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details",
           "--disable-log-stats"]  # as Crescent's instance starts its engine (services/engine_vllm/engine.py)
    if args.peer_dp > 1:  # as many engine processes as Crescent's pools (vLLM's own data parallelism)
        cmd += ["--data-parallel-size", str(args.peer_dp)]
    args.peer_cache.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=run_dir, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent, env=peer_env(args))
    return Server("vllm", f"http://127.0.0.1:{port}", proc, log)


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_ready(server: Server, timeout: float) -> None:
    """/health 200, then a completion that succeeds (Crescent's gateway is up before its engine)."""
    deadline = time.perf_counter() + timeout
    healthy = False
    with err.status(f"starting {server.name} at {server.url} (log {server.log})") as status:
        while time.perf_counter() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {server.proc.returncode} while starting; "
                                   f"log {server.log}:\n{tail(server.log)}")
            server.track()
            try:
                if not healthy:
                    healthy = httpx.get(f"{server.url}/health", timeout=5).status_code == 200
                    if healthy:
                        status.update(f"{server.name}: /health 200 after {time.perf_counter() - server.started:.0f} s; "
                                      "waiting for a completion")
                if healthy:
                    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
                        "model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
                        "temperature": 0})
                    if r.status_code == 200:
                        server.ready_s = time.perf_counter() - server.started
                        server.track()
                        return
            except httpx.HTTPError:
                pass
            time.sleep(2)
    raise RuntimeError(f"{server.name} not ready within {timeout:.0f} s; log {server.log}:\n{tail(server.log)}")


# ---------------------------------------------------------------- 1. light load
def prompt_text(index: int, tokens: int) -> str:
    """A new prompt of about ``tokens`` tokens (each word is about one token; the chat template
    adds ~10), the same for every target: each server starts cold, so it is a cold prefill."""
    rng = random.Random(f"bench-vllm-backend:{index}:{tokens}")
    words = " ".join(rng.choice(WORDS) for _ in range(max(1, tokens - 40)))
    return f"Request {index}. Read these words and then write a long story about them: {words}"


def stream_one(url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    arrivals: list[float] = []
    usage: dict = {}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {
        "ttft_s": (arrivals[0] if arrivals else end) - start,
        "mean_tbt_s": statistics.fmean(gaps) if gaps else None,
        "max_gap_s": max(gaps) if gaps else None,
        "latency_s": end - start, "chunks": len(arrivals),
        "prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
    }


def med(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def light_load(url: str, args: argparse.Namespace) -> dict:
    sizes = [args.short_tokens if i % 2 == 0 else args.long_tokens for i in range(args.requests)]
    stream_one(url, prompt_text(-1, args.short_tokens), args.max_tokens)  # warm-up: not counted
    rows = []
    with err.status("light load") as status:
        for i, size in enumerate(sizes):
            status.update(f"light load: request {i + 1}/{len(sizes)} (~{size} tokens, cold)")
            rows.append({"index": i, "size": size, "kind": "cold", **stream_one(url, prompt_text(i, size), args.max_tokens)})
        for i in range(min(args.warm, len(sizes))):
            status.update(f"light load: request {i + 1}/{args.warm} again (prefix cached)")
            rows.append({"index": i, "size": sizes[i], "kind": "warm",
                         **stream_one(url, prompt_text(i, sizes[i]), args.max_tokens)})
    cold = [r for r in rows if r["kind"] == "cold"]
    warm = [r for r in rows if r["kind"] == "warm"]
    summary = {
        "ttft_p50_s": med([r["ttft_s"] for r in cold]),
        "tbt_p50_s": med([r["mean_tbt_s"] for r in cold]),
        "ttft_p50_short_s": med([r["ttft_s"] for r in cold if r["size"] == args.short_tokens]),
        "ttft_p50_long_s": med([r["ttft_s"] for r in cold if r["size"] == args.long_tokens]),
        "warm_ttft_p50_s": med([r["ttft_s"] for r in warm]),
        "warm_tbt_p50_s": med([r["mean_tbt_s"] for r in warm]),
        "prompt_tokens_short": med([r["prompt_tokens"] for r in cold if r["size"] == args.short_tokens]),
        "prompt_tokens_long": med([r["prompt_tokens"] for r in cold if r["size"] == args.long_tokens]),
        "cold_cached_fraction": (sum(r["cached_tokens"] for r in cold) / max(1, sum(r["prompt_tokens"] for r in cold))),
        "warm_cached_fraction": (sum(r["cached_tokens"] for r in warm) / max(1, sum(r["prompt_tokens"] for r in warm))
                                 if warm else None),
        "completion_tokens_p50": med([r["completion_tokens"] for r in cold]),
        "chunks_p50": med([r["chunks"] for r in cold]),
    }
    return {"summary": summary, "requests": rows}


# ---------------------------------------------------------------- 2. the replay sweep
async def sweep(url: str, args: argparse.Namespace, name: str) -> list[dict]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    trace = load_trace(args.trace, args.skip + args.max_requests)[args.skip:]
    reports = []
    for level, rate in enumerate(args.rate_list):
        cfg = ReplayConfig(url=url, model=MODEL, api="chat", tokens_per_block=args.tokens_per_block,
                           output_scale=args.output_scale, rate=rate, max_requests=args.max_requests,
                           max_seconds=args.max_seconds, ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo,
                           seed=args.seed + level)
        load0 = loadavg()
        with Progress(TextColumn(f"{name} {rate:g} req/s"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err) as bar:
            report = await replay(cfg, trace, bar)
        report |= {"target": name, "rate": rate, "level": level, "trace_skip": args.skip,
                   "loadavg_start": load0, "loadavg_end": loadavg(), "finished_at": now_utc()}
        reports.append(report)
        err.print(f"{name} {rate:g} req/s: {report['completed']}/{report['requests']} completed, "
                  f"effective capacity {fmt(report['effective_capacity'], '.0%')}")
    return reports


# ---------------------------------------------------------------- output
def fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_target(result: dict) -> None:
    name = result["target"]
    s = (result.get("light_load") or {}).get("summary")
    t = Table(title=f"{name}: light load, sequential requests (medians; {result['started_at']}, ready in "
                    f"{fmt(result['ready_s'], '.0f')} s)")
    for col in ("TTFT cold, all", "TTFT ~short", "TTFT ~long", "mean TBT cold", "TTFT warm", "mean TBT warm",
                "prompt tokens short/long", "cached cold / warm"):
        t.add_column(col)
    if s:
        t.add_row(fmt(s["ttft_p50_s"]), fmt(s["ttft_p50_short_s"]), fmt(s["ttft_p50_long_s"]), fmt(s["tbt_p50_s"], ".4f"),
                  fmt(s["warm_ttft_p50_s"]), fmt(s["warm_tbt_p50_s"], ".4f"),
                  f"{fmt(s['prompt_tokens_short'], '.0f')} / {fmt(s['prompt_tokens_long'], '.0f')}",
                  f"{fmt(s['cold_cached_fraction'], '.0%')} / {fmt(s['warm_cached_fraction'], '.0%')}")
        console.print(t)
    t = Table(title=f"{name}: replay sweep ({result['sweep'][0]['requests'] if result['sweep'] else 0} requests per level, "
                    f"SLOs TTFT <= {result['sweep'][0]['ttft_slo_s'] if result['sweep'] else '-'} s, "
                    f"TBT <= {result['sweep'][0]['tbt_slo_s'] if result['sweep'] else '-'} s)")
    for col in ("rate", "offered", "done / failed", "TTFT p50 / p90 / p99", "TBT p50 / p90 / p99", "TTFT / TBT SLO met",
                "eff. capacity", "cached / bound", "load avg"):
        t.add_column(col)
    for r in result["sweep"]:
        tt, tb = r["ttft_s"], r["tbt_s"]
        t.add_row(f"{r['rate']:g}", fmt(r["offered_rps"]), f"{r['completed']} / {r['failed']}",
                  " / ".join(fmt(tt[k], ".2f") for k in ("p50", "p90", "p99")),
                  " / ".join(fmt(tb[k], ".2f") for k in ("p50", "p90", "p99")),
                  f"{fmt(r['ttft_attainment'], '.0%')} / {fmt(r['tbt_attainment'], '.0%')}",
                  fmt(r["effective_capacity"], ".0%"),
                  f"{fmt(r['cached_fraction'], '.1%')} / {r['theoretical_cached_fraction']['tokens']:.1%}",
                  f"{r['loadavg_start'][0]:.1f}→{r['loadavg_end'][0]:.1f}")
    console.print(t)
    if result["sweep"]:
        rate, at_least = rate_capacity(result["sweep"])
        said = "below the lowest level" if rate is None else f"{'at least ' if at_least else ''}{rate:.2f} req/s"
        console.print(f"{name}: effective request capacity (90% within both SLOs) {said}")
        for r in result["sweep"]:
            if r["rejections"]:
                console.print(f"  {r['rate']:g} req/s failures: {r['rejections']}")


def compare(results: dict[str, dict]) -> dict:
    """Each Crescent target against standalone vLLM."""
    return {name: compare_one(name, results) for name in ("crescent", "crescent-pools")
            if results.get(name) and results.get("vllm")}


def compare_one(name: str, results: dict[str, dict]) -> dict:
    c, v = results[name], results["vllm"]
    cs = (c.get("light_load") or {}).get("summary") or {}
    vs = (v.get("light_load") or {}).get("summary") or {}
    ratios = []
    rows = (("TTFT p50, cold (all)", "ttft_p50_s", True), ("mean TBT p50, cold", "tbt_p50_s", True),
            ("TTFT p50, ~short cold", "ttft_p50_short_s", False), ("TTFT p50, ~long cold", "ttft_p50_long_s", False),
            ("TTFT p50, warm (cached prefix)", "warm_ttft_p50_s", False), ("mean TBT p50, warm", "warm_tbt_p50_s", False))
    t = Table(title=f"light load: what Crescent adds ({name} / vllm; target < {OVERHEAD_TARGET:.2f})")
    for col in ("metric", "crescent", "vllm", "ratio", "added", "pass", "headline"):
        t.add_column(col)
    for label, key, headline in rows:
        a, b = cs.get(key), vs.get(key)
        ratio = a / b if a is not None and b else None
        ok = ratio is not None and ratio < OVERHEAD_TARGET
        ratios.append({"metric": key, "label": label, "crescent": a, "vllm": b, "ratio": ratio, "pass": ok,
                       "headline": headline})
        t.add_row(label, fmt(a, ".4f"), fmt(b, ".4f"), fmt(ratio, ".3f"),
                  "-" if a is None or b is None else f"{1000 * (a - b):+.1f} ms",
                  "[green]pass[/]" if ok else "[red]FAIL[/]", "yes" if headline else "")
    console.print(t)
    goodput = []
    t = Table(title=f"goodput per load level (effective request capacity; target: {name} >= vllm)")
    for col in ("rate", "crescent offered", "crescent", "vllm offered", "vllm", "difference", "pass"):
        t.add_column(col)
    by_rate = {r["rate"]: r for r in v["sweep"]}
    for rc in c["sweep"]:
        rv = by_rate.get(rc["rate"])
        if rv is None:
            continue
        a, b = rc["effective_capacity"], rv["effective_capacity"]
        ok = a is not None and b is not None and a >= b
        goodput.append({"rate": rc["rate"], "crescent": a, "vllm": b, "pass": ok,
                        "crescent_offered_rps": rc["offered_rps"], "vllm_offered_rps": rv["offered_rps"]})
        t.add_row(f"{rc['rate']:g}", fmt(rc["offered_rps"]), fmt(a, ".0%"), fmt(rv["offered_rps"]), fmt(b, ".0%"),
                  "-" if a is None or b is None else f"{100 * (a - b):+.1f} pts", "[green]pass[/]" if ok else "[red]FAIL[/]")
    console.print(t)
    cap = {n: rate_capacity(results[n]["sweep"]) for n in (name, "vllm")}
    for n, (rate, at_least) in cap.items():
        console.print(f"{n}: effective request capacity {'below the lowest level' if rate is None else ('at least ' if at_least else '') + f'{rate:.2f} req/s'}")
    overhead_pass = all(r["pass"] for r in ratios if r["headline"])
    goodput_pass = bool(goodput) and all(g["pass"] for g in goodput)
    console.print(f"overhead target (TTFT and TBT p50 at light load < {OVERHEAD_TARGET:.2f}x vLLM's): "
                  f"{'[green]pass[/]' if overhead_pass else '[red]FAIL[/]'}; "
                  f"goodput target ({name} >= vllm at every level): {'[green]pass[/]' if goodput_pass else '[red]FAIL[/]'}")
    return {"light_load_ratios": ratios, "goodput": goodput, "overhead_pass": overhead_pass, "goodput_pass": goodput_pass,
            "rate_capacity": {n: {"rps": r, "at_least": a} for n, (r, a) in cap.items()}}


# ---------------------------------------------------------------- the run
def run_target(name: str, args: argparse.Namespace, run_dir: Path) -> dict:
    result: dict[str, Any] = {"target": name, "started_at": now_utc(), "loadavg_start": loadavg()}
    server = start_vllm(args, run_dir) if name == "vllm" else start_crescent(args, run_dir, name)
    result["log"] = str(server.log)
    try:
        wait_ready(server, args.ready_timeout)
        result["ready_s"] = server.ready_s
        err.print(f"[green]{name} ready[/] at {server.url} after {server.ready_s:.0f} s")
        result["loadavg_ready"] = loadavg()
        if args.requests > 0:
            result["light_load"] = light_load(server.url, args)
        server.track()
        result["sweep"] = asyncio.run(sweep(server.url, args, name)) if args.rate_list else []
        server.track()
        result["server_exit_code_before_stop"] = server.proc.poll()  # None: still serving, as it should be
    finally:
        err.print(f"stopping {name}…")
        server.stop()
        result |= {"stop_s": server.stop_s, "processes_tracked": len(server.seen),
                   "processes_left_after_stop": server.left_after_stop,
                   "processes_left": server.left_names, "exit_code": server.proc.returncode,
                   "finished_at": now_utc(), "loadavg_end": loadavg()}
        err.print(f"{name} stopped in {server.stop_s:.1f} s (exit {server.proc.returncode}; "
                  f"{server.left_after_stop} process(es) left behind and killed)")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                   help="comma-separated, in order, of: crescent (one aggregated vLLM instance), crescent-pools "
                        "(a vLLM prefill and a vLLM decode), vllm")
    p.add_argument("--requests", type=int, default=12, help="light load: sequential requests (after a warm-up)")
    p.add_argument("--warm", type=int, default=4, help="light load: then send this many of those prompts again")
    p.add_argument("--short-tokens", type=int, default=300, help="light load: the short prompt's size (tokens)")
    p.add_argument("--long-tokens", type=int, default=1000, help="light load: the long prompt's size (tokens)")
    p.add_argument("--max-tokens", type=int, default=64, help="light load: output tokens per request (ignore_eos)")
    p.add_argument("--rates", default="0.2,0.4,0.8,1.6", help="replay sweep load levels, requests/s ('' for none)")
    p.add_argument("--max-requests", type=int, default=40, help="replay: the trace's first N requests per level")
    p.add_argument("--skip", type=int, default=0, help="replay: start at this request of the trace")
    p.add_argument("--max-seconds", type=float, default=420.0, help="replay: bound on one level (then cut off)")
    p.add_argument("--ttft-slo", type=float, default=10.0, help="seconds")
    p.add_argument("--tbt-slo", type=float, default=1.0, help="seconds (Mooncake TBT: mean of the longest 10%% gaps)")
    p.add_argument("--tokens-per-block", type=int, default=16, help="replay: words per 512-token trace block")
    p.add_argument("--output-scale", type=float, default=32.0, help="replay: divide the trace's output lengths by this")
    p.add_argument("--seed", type=int, default=10, help="replay: block-text seed (level i uses seed + i)")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for a server to serve")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="standalone vLLM's VLLM_CPU_KVCACHE_SPACE (Crescent's default)")
    p.add_argument("--peer-dp", type=int, default=1,
                   help="standalone vLLM's engine processes (--data-parallel-size): 2 to match --targets crescent-pools")
    p.add_argument("--peer-omp", choices=("crescent", "vllm"), default="crescent",
                   help="standalone vLLM's OpenMP setup: the one Crescent's launcher gives its engine, or vLLM's own "
                        "defaults (VLLM_CPU_OMP_THREADS_BIND=auto: on 2 cores, 1 thread and a core reserved)")
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    p.add_argument("--model-dir", type=Path, help="the float32 HF directory (default: Crescent's export of the default model)")
    p.add_argument("--peer-cache", type=Path, default=Path.home() / ".cache" / "crescent" / "bench-vllm-peer",
                   help="standalone vLLM's VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR parent (compile caches: start time only)")
    p.add_argument("--run-dir", type=Path, help="logs and Crescent's run dir (default: a new temp dir)")
    p.add_argument("--json", type=Path, help="write everything here")
    args = p.parse_args(argv)
    args.target_list = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in args.target_list if t not in TARGETS]
    if bad:
        p.error(f"unknown target(s) {bad}; choose from {TARGETS}")
    args.rate_list = [float(r) for r in args.rates.split(",") if r.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="bench-vllm-backend-"))
    run_dir.mkdir(parents=True, exist_ok=True)

    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # the same clean stop as Ctrl-C

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    doc: dict[str, Any] = {
        "benchmark": "bench_vllm_backend", "argv": sys.argv, "started_at": now_utc(), "loadavg_start": loadavg(),
        "machine": lscpu(), "git": git_state(), "run_dir": str(run_dir),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": {},
    }
    m = doc["machine"]
    err.print(f"machine: {m['model_name']}, {m['cpus']} CPUs, avx2={m['avx2']} avx512f={m['avx512f']} "
              f"avx512_bf16={m['avx512_bf16']}; load average {doc['loadavg_start']}; logs in {run_dir}")
    code = 0
    try:
        for name in args.target_list:
            doc["results"][name] = run_target(name, args, run_dir)
            print_target(doc["results"][name])
    except KeyboardInterrupt:
        err.print("[yellow]interrupted: the server was stopped; partial results kept[/]")
        doc["interrupted"] = True
        code = 130
    except RuntimeError as exc:
        err.print(f"[red]{exc}[/]")
        doc["error"] = str(exc)
        code = 1
    doc |= {"finished_at": now_utc(), "loadavg_end": loadavg()}
    if not doc.get("interrupted") and not doc.get("error"):
        doc["comparison"] = compare(doc["results"])
    console.print(f"machine: {m['model_name']} ({m['cpus']} CPUs; {' '.join(m['simd'])}); "
                  f"{doc['started_at']} → {doc['finished_at']}; load average {doc['loadavg_start']} → {doc['loadavg_end']}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
        console.print(f"wrote {args.json}")
    return code


if __name__ == "__main__":
    sys.exit(main())
