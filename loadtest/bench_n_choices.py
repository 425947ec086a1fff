#!/usr/bin/env python
"""``n > 1`` as one placement on the prompt's shared KV, against the fan-out it replaced; one JSON line.

Each round sends a fresh long prompt (nothing cached) two ways, alternating which goes first:
- **group**: one streamed request with ``n`` choices (prefill once, one handoff, decode forks the
  prompt's KV);
- **fan-out**: what the gateway did before: choice 0 as its own request, then, once it has its
  first token, the other ``n - 1`` as requests of their own with their choices' seeds (they find
  the prompt's full blocks in prefill's cache; each is handed off with its own copy of the KV).
Figures per way (medians over ``--rounds``): time until every choice has its first token, until
all are done, prompt tokens prefill computed, KV bytes handed to decode, and the decode KV
tokens in use at the peak (sampled from /metrics while the request runs).

  python loadtest/bench_n_choices.py --start
  python loadtest/bench_n_choices.py --url http://127.0.0.1:8000 --run-dir /tmp/crescent-run --n 4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_request_path import start_stack  # noqa: E402

from crescent.services.contract.choices import choice_seed  # noqa: E402

SEED = 2026


def metric_total(run_dir: Path, role: str, metric: str, labels: str = "") -> float:
    """Sum of a sample over every service of ``role`` (``labels``: a substring the sample must hold)."""
    total = 0.0
    for s in json.loads((run_dir / "services.json").read_text()):
        if s["role"] != role:
            continue
        for line in httpx.get(s["metrics_url"], timeout=5).text.splitlines():
            if line.startswith(metric) and labels in line and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
    return total


WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word").split()


def prompt(tokens: int) -> list[dict]:
    """A prompt nobody sent before of about ``tokens`` tokens (common words are one token each)."""
    words = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(tokens))
    return [{"role": "user", "content": f"{uuid.uuid4().hex} {words}\nSummarise."}]


def stream(url: str, model: str, messages: list[dict], max_tokens: int, n: int, seed: int,
           first_token: threading.Event | None = None) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
            "n": n, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    firsts: dict[int, float] = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices", []):
                if c["delta"].get("content") and c["index"] not in firsts:
                    firsts[c["index"]] = time.perf_counter()
                    if first_token is not None:
                        first_token.set()
    return {"start": start, "firsts": list(firsts.values()), "end": time.perf_counter()}


def peak_kv(run_dir: Path, stop: threading.Event, into: list[float]) -> None:
    while not stop.is_set():
        into.append(metric_total(run_dir, "decode", "crescent_engine_kv_used_tokens"))
        stop.wait(0.1)


def one_way(way: str, url: str, model: str, run_dir: Path, tokens: int, n: int, max_tokens: int) -> dict:
    messages = prompt(tokens)
    computed = metric_total(run_dir, "prefill", "crescent_engine_computed_tokens_total")
    handed = metric_total(run_dir, "decode", "crescent_engine_kv_transfer_bytes_total", 'direction="handoff_in"')
    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=peak_kv, args=(run_dir, stop, samples))
    sampler.start()
    try:
        if way == "group":
            runs = [stream(url, model, messages, max_tokens, n, SEED)]
        else:
            leader_started = threading.Event()
            with ThreadPoolExecutor(n) as pool:
                leader = pool.submit(stream, url, model, messages, max_tokens, 1, SEED, leader_started)
                leader_started.wait(600)
                others = [pool.submit(stream, url, model, messages, max_tokens, 1, choice_seed(SEED, i))
                          for i in range(1, n)]
                runs = [leader.result(), *(f.result() for f in others)]
    finally:
        stop.set()
        sampler.join()
    start = min(r["start"] for r in runs)
    return {
        "all_first_tokens_s": max(t for r in runs for t in r["firsts"]) - start,
        "all_done_s": max(r["end"] for r in runs) - start,
        "prefill_computed_tokens": metric_total(run_dir, "prefill", "crescent_engine_computed_tokens_total") - computed,
        "handoff_mb": (metric_total(run_dir, "decode", "crescent_engine_kv_transfer_bytes_total",
                                    'direction="handoff_in"') - handed) / 2**20,
        "decode_kv_peak_tokens": max(samples, default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--run-dir", type=Path, help="the stack's run directory (services.json); with --url")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--start", action="store_true", help="start `crescent up` on a free port and stop it after")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    proc, url, run_dir = None, args.url, args.run_dir
    if args.start:
        run_dir = Path(tempfile.mkdtemp(prefix="crescent-bench-"))
        proc, url = start_stack(run_dir)
    if run_dir is None:
        raise SystemExit("--run-dir is needed with --url (the figures come from the services' /metrics)")
    results: dict[str, list[dict]] = {"group": [], "fan_out": []}
    try:
        stream(url, args.model, [{"role": "user", "content": "warm-up"}], 4, 1, SEED)
        for r in range(args.rounds):
            for way in (("group", "fan_out") if r % 2 == 0 else ("fan_out", "group")):
                results[way].append(one_way(way, url, args.model, run_dir, args.prompt_tokens, args.n,
                                            args.max_tokens))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    figures = {way: {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
               for way, runs in results.items()}
    figures.update(n=args.n, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, rounds=args.rounds,
                   machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
                   date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
