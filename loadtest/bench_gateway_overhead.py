#!/usr/bin/env python
"""What auth, rate limits and the usage ledger add to a request's latency; prints one JSON line.

Starts the test fake engines (instant replies, tests/gateway/fake_backend.py), a redis-server,
and one real gateway process per configuration in turn, all on loopback:

- ``baseline``: auth off, no limits, no ledger;
- ``auth``: API keys on;
- ``auth+limits``: and the key held to all four limits (rpm, tpm, concurrency, budget; set too
  high to refuse anything) in Redis;
- ``auth+limits+ledger``: and the usage ledger (when this checkout has one, ``ledger`` in the
  gateway settings).

Then ``steps_alone``: the three steps' own work on a request's path, at the same concurrency in
one event loop: the key's check, the limiter's admission, then at the request's end the settle
and the ledger's row with the wait a response makes for it; against the in-process store and the
redis-server, with the ledger's journal and without (waiting for the commit). Requests generate
for ``--service-ms`` (0.5-1.5x, clients started at random moments: 50 concurrent LLM requests in
steady state) and back to back (a saturated loop).

Each configuration answers ``--requests`` chat completions from ``--concurrency`` clients
(after a warm-up), then ``--serial`` requests one at a time; reported are p50/p99 latencies and
their difference to the baseline. One at a time shows the latency the steps themselves add; at
50 concurrent requests on a machine with few cores the difference also holds their CPU time
multiplied by the queue it joins, so the throughput is reported too: ``added_cost_ms`` is what
a request costs the saturated machine beyond the baseline.

  python loadtest/bench_gateway_overhead.py [--requests 2000] [--concurrency 50] [--serial 300] [--steps-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from crescent.services.gateway.config import GatewaySettings  # noqa: E402
from crescent.services.tenancy import KeyStore, connect_database  # noqa: E402
from tests.gateway.support import FakeBackend, Gateway  # noqa: E402
from tests.tenancy.redis_server import redis_server  # noqa: E402

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there, how are you"}], "max_tokens": 4}
NEVER_REFUSE = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10_000, "budget_usd": "1000000"}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def drive(url: str, key: str | None, requests: int, concurrency: int) -> list[float]:
    """Latencies (s) of ``requests`` chat completions sent by ``concurrency`` clients."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    latencies: list[float] = []
    left = iter(range(requests))
    # Idle pooled connections expire before the server's 5 s keep-alive closes them (a reused, just-closed
    # connection is an httpx.ReadError).
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as http:
        async def client() -> None:
            for _ in left:
                started = time.perf_counter()
                reply = await http.post("/v1/chat/completions", json=BODY)
                latencies.append(time.perf_counter() - started)
                if reply.status_code != 200:
                    raise RuntimeError(f"{reply.status_code}: {reply.text}")

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


async def steps_overhead(store_url: str, journal: bool, root: Path, requests: int, concurrency: int,
                         service_s: float) -> dict[str, float]:
    """What auth + limits + ledger add to one request, ``concurrency`` requests at a time in one
    event loop, each generating for ``service_s`` between admission and its end (0: back to back,
    the loop saturated): the key's check, the limiter's admission (all four limits, key and
    tenant), then at the end the limiter's settle and the ledger's row with the wait a response
    makes for it (a durable ledger: the journal's write, or the commit without a journal)."""
    from crescent.services.gateway.accounting import UsageCounts
    from crescent.services.gateway.auth import Authenticator
    from crescent.services.gateway.config import AuthSettings, LedgerSettings
    from crescent.services.gateway.ledger import UsageLedger
    from crescent.services.gateway.limits.settings import LimitSettings
    from crescent.services.gateway.limits.limiter import RateLimiter
    from crescent.services.tenancy.pricing import PriceTable
    from crescent.services.tenancy.usage import UsageStore

    tag = f"{'redis' if store_url != 'memory' else 'memory'}-{'journal' if journal else 'commit'}-{service_s}"
    database = f"sqlite:///{root}/steps-{tag}.sqlite3"
    key = KeyStore(connect_database(database)).create_key("bench", create_tenant=True).key
    auth = Authenticator.open(AuthSettings(enabled=True, database_url=database))
    header = f"Bearer {key}"
    principal = await auth.principal(header)
    ledger = UsageLedger(UsageStore(auth.store.engine), PriceTable(),
                         LedgerSettings(journal_dir=str(root / f"journal-{tag}") if journal else None))
    ledger.start()
    settings = LimitSettings(store=store_url, key=NEVER_REFUSE, tenant=NEVER_REFUSE)
    limiter = RateLimiter.open(settings, None, PriceTable())
    limiter.start()
    latencies: list[float] = []
    unlimited: list[int] = []
    left = iter(range(requests))
    jitter = random.Random(0)

    async def client() -> None:
        if service_s:  # in steady state requests start and end at different moments, not in bursts
            await asyncio.sleep(jitter.uniform(0, service_s))
        for i in left:
            started = time.perf_counter()
            await auth.principal(header)
            ticket = await limiter.admit(principal, "fake-model", 20, 4)
            admitted = time.perf_counter()
            if service_s:
                await asyncio.sleep(service_s * jitter.uniform(0.5, 1.5))
            ending = time.perf_counter()
            if ticket is None:  # the store failed and the limiter let the request through (fail open)
                unlimited.append(i)
            else:
                await limiter.settle(ticket, UsageCounts(20, 16, 4))
            account = ledger.account(f"req-{tag}-{i}", principal, "fake-model")
            account.settle("ok", UsageCounts(20, 16, 4), 0, 0.1)
            await account.committed()
            latencies.append(admitted - started + time.perf_counter() - ending)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    await limiter.close()
    await ledger.close()
    auth.close()
    return {"p50_ms": round(statistics.median(latencies) * 1000, 3),
            "p99_ms": round(percentile(latencies, 0.99) * 1000, 3), "store_failures": len(unlimited)}


def configurations(redis_url: str) -> dict[str, dict[str, Any]]:
    has_ledger = "ledger" in GatewaySettings.model_fields
    ledger_off = {"ledger": {"enabled": False}} if has_ledger else {}
    limits = {"limits": {"store": redis_url, "key": NEVER_REFUSE}}
    configs = {
        "baseline": {"auth": {"enabled": False}, **ledger_off},
        "auth": {"auth": {"enabled": True}, **ledger_off},
        "auth+limits": {"auth": {"enabled": True}, **limits, **ledger_off},
    }
    if has_ledger:
        configs["auth+limits+ledger"] = {"auth": {"enabled": True}, **limits}
    return configs


def measure(name: str, settings: dict[str, Any], backend: FakeBackend, root: Path, args: argparse.Namespace) -> dict:
    database = f"sqlite:///{root}/{name}.sqlite3"
    key = None
    if settings["auth"]["enabled"]:
        key = KeyStore(connect_database(database)).create_key("bench", create_tenant=True).key
    gw = Gateway(root, backend.address, **{**settings, "auth": {**settings["auth"], "database_url": database}})
    gw.start_gateway()
    print(f"bench_gateway_overhead: {name} on {gw.url}", file=sys.stderr)
    try:
        asyncio.run(drive(gw.url, key, args.warmup, args.concurrency))
        started = time.perf_counter()
        loaded = asyncio.run(drive(gw.url, key, args.requests, args.concurrency))
        throughput = args.requests / (time.perf_counter() - started)
        serial = asyncio.run(drive(gw.url, key, args.serial, 1))
    finally:
        gw.stop()
    ms = 1000.0
    return {"requests_per_s": round(throughput, 1), "p50_ms": round(statistics.median(loaded) * ms, 2),
            "p99_ms": round(percentile(loaded, 0.99) * ms, 2),
            "serial_p50_ms": round(statistics.median(serial) * ms, 3),
            "serial_p99_ms": round(percentile(serial, 0.99) * ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--serial", type=int, default=300)
    parser.add_argument("--service-ms", type=float, default=1000.0,
                        help="how long each request generates (0.5-1.5x, staggered) in steps_alone")
    parser.add_argument("--steps-only", action="store_true", help="only steps_alone (no gateway processes)")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="crescent-bench-") as tmp, redis_server() as redis:
        backend = FakeBackend()
        backend.start_backend()
        try:
            for name, settings in ({} if args.steps_only else configurations(redis.url)).items():
                results[name] = measure(name, settings, backend, Path(tmp), args)
        finally:
            backend.stop()
        steps = {f"{store}, ledger {'journal' if journal else 'commit wait'}, {service_ms:g} ms requests":
                 asyncio.run(steps_overhead(url, journal, Path(tmp), args.requests * 2, args.concurrency,
                                            service_ms / 1000))
                 for store, url in (("memory", "memory"), ("redis", redis.url))
                 for journal in (True, False)
                 for service_ms in (args.service_ms, 0)}
    base = results.get("baseline")
    for name, figures in results.items() if base else ():
        # The machine saturated: what each request costs beyond the baseline, in time of the whole machine.
        figures["added_cost_ms"] = round(1000 / figures["requests_per_s"] - 1000 / base["requests_per_s"], 3)
        figures["added_p50_ms"] = round(figures["p50_ms"] - base["p50_ms"], 2)
        figures["added_p99_ms"] = round(figures["p99_ms"] - base["p99_ms"], 2)
        figures["serial_added_p50_ms"] = round(figures["serial_p50_ms"] - base["serial_p50_ms"], 3)
        figures["serial_added_p99_ms"] = round(figures["serial_p99_ms"] - base["serial_p99_ms"], 3)
    print(json.dumps({"bench": "gateway_overhead", "date": datetime.now(UTC).isoformat(timespec="seconds"),
                      "machine": platform.processor() or platform.machine(), "requests": args.requests,
                      "concurrency": args.concurrency, "steps_alone": steps, "results": results}))


if __name__ == "__main__":
    main()
