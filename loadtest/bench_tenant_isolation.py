#!/usr/bin/env python
"""Tenant isolation of the prefix cache, measured: two tenants send the same long prompt.

Each try sends a fresh ~1,500-token prompt (a random nonce first, so tries share nothing): one
tenant cold, the same tenant again (a cache hit), then the other tenant (must be as slow as
cold, with ``cached_tokens`` 0). The tenants swap roles every try, and each request waits
``--settle`` seconds first, so the previous request's background writes to the kvstore do not
land on the next one's figure. Prints the three TTFT distributions (one-token replies, seconds)
and the cached tokens, as one JSON line, plus a human summary on stderr.

  python loadtest/bench_tenant_isolation.py --start            # its own `crescent up`, auth on
  python loadtest/bench_tenant_isolation.py --url http://127.0.0.1:8000 --admin-key KEY
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import httpx

from crescent.services.common.ports import unused_port


def start_stack(run_dir: Path, admin_key: str) -> tuple[subprocess.Popen, str]:
    port = unused_port()
    env = {**os.environ, "CRESCENT_GATEWAY__AUTH__ENABLED": "true", "CRESCENT_GATEWAY__AUTH__ADMIN_KEY": admin_key,
           "CRESCENT_GATEWAY__AUTH__DATABASE_URL": f"sqlite:///{run_dir}/gateway.sqlite3"}
    proc = subprocess.Popen([sys.executable, "-m", "crescent.services.cli", "up", "--port", str(port),
                             "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"crescent up failed; logs in {run_dir}")
        if (run_dir / "services.json").exists():
            return proc, url
        time.sleep(0.5)


def key_for(url: str, admin_key: str, tenant: str) -> str:
    reply = httpx.post(f"{url}/admin/keys", json={"tenant": tenant, "create_tenant": True, "name": "bench"},
                       headers={"Authorization": f"Bearer {admin_key}"}, timeout=10)
    reply.raise_for_status()
    return reply.json()["key"]


def document(nonce: str, words: int) -> str:
    body = " ".join(f"item {i} ships to depot {i * 7 % 13}." for i in range(words // 6))
    return f"Reference {nonce}. Summarise the manifest.\n{body}"


def timed(url: str, model: str, key: str, content: str) -> tuple[float, int, int]:
    start = time.perf_counter()
    reply = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                       json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1})
    elapsed = time.perf_counter() - start
    reply.raise_for_status()
    usage = reply.json()["usage"]
    return elapsed, usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"min": round(ordered[0], 3), "median": round(statistics.median(ordered), 3),
            "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3), "max": round(ordered[-1], 3)}


def measure(url: str, model: str, admin_key: str, tries: int, words: int, settle_s: float) -> dict:
    a, b = key_for(url, admin_key, "bench-tenant-a"), key_for(url, admin_key, "bench-tenant-b")
    timed(url, model, a, "warm-up")
    timed(url, model, b, "warm-up")
    runs: dict[str, list[float]] = {"cold": [], "same_tenant_repeat": [], "other_tenant_first": []}
    cached: dict[str, list[int]] = {name: [] for name in runs}
    tokens = 0
    for i in range(tries):
        prompt = document(uuid.uuid4().hex, words)
        first, other = (a, b) if i % 2 == 0 else (b, a)
        for name, key in (("cold", first), ("same_tenant_repeat", first), ("other_tenant_first", other)):
            time.sleep(settle_s)
            seconds, tokens, hit = timed(url, model, key, prompt)
            runs[name].append(seconds)
            cached[name].append(hit)
        print(f"try {i + 1}/{tries}: " + ", ".join(f"{n} {runs[n][-1]:.2f}s (cached {cached[n][-1]})" for n in runs),
              file=sys.stderr)
    return {"prompt_tokens": tokens, "tries": tries, "ttft_s": {n: summary(v) for n, v in runs.items()},
            "ttft_s_all": {n: [round(x, 3) for x in v] for n, v in runs.items()},
            "cached_tokens": {n: sorted(set(v)) for n, v in cached.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--admin-key", default="", help="the gateway's auth.admin_key (--start makes one)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--start", action="store_true", help="start `crescent up` with auth on, stop it after")
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--words", type=int, default=820, help="prompt size (820 words ≈ 1,500 tokens)")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds of quiet before each request")
    args = parser.parse_args()
    proc, url, admin_key = None, args.url, args.admin_key
    if args.start:
        admin_key = "admin-" + uuid.uuid4().hex
        proc, url = start_stack(Path(tempfile.mkdtemp(prefix="crescent-bench-")), admin_key)
    if not admin_key:
        raise SystemExit("--admin-key is needed (or --start)")
    try:
        figures = measure(url, args.model, admin_key, args.tries, args.words, args.settle)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
    t = figures["ttft_s"]
    print(f"TTFT medians: cold {t['cold']['median']} s, same tenant repeat {t['same_tenant_repeat']['median']} s, "
          f"other tenant first {t['other_tenant_first']['median']} s; cached tokens {figures['cached_tokens']}",
          file=sys.stderr)
    figures.update(machine=f"{platform.machine()} {platform.processor() or ''}".strip(), cores=os.cpu_count(),
                   date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
