"""How long one live placement decision takes: 32 instances, 1M indexed blocks.

    .venv/bin/python loadtest/bench_scheduler_decision.py [--blocks 1000000] [--prompt-blocks 64]

Drives the Conductor (the code behind the Place RPC, without the network) and prints one JSON
line with p50/p99/max decision latency per policy (wall clock, and CPU time of the deciding
thread, which a busy shared machine does not inflate) and the index's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time

from crescent.services.contract.block_keys import BlockKey
from crescent.services.scheduler.conductor import BlockUpdate, Conductor
from crescent.services.scheduler.config import SchedulerSettings
from crescent.services.scheduler.datatypes import InstanceId, Role, Tier
from crescent.services.scheduler.registry import InstanceSpec, LoadReport


def chain(rng: random.Random, n: int) -> list[BlockKey]:
    return [BlockKey(rng.randbytes(16)) for _ in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, default=32, help="half prefill, half decode")
    p.add_argument("--kvstores", type=int, default=4)
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--prompt-blocks", type=int, default=64)
    p.add_argument("--decisions", type=int, default=5000)
    args = p.parse_args()
    rng = random.Random(0)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out: dict[str, object] = {"instances": args.instances, "prompt_blocks": args.prompt_blocks}
    for policy in ("cache_aware", "kvcache_centric", "least_loaded"):
        settings = SchedulerSettings.model_validate({"policy": {"name": policy}, "heartbeat_timeout_s": 1e9, "index": {"max_blocks": 2 * args.blocks}})
        conductor = Conductor(settings)
        prefill = [InstanceId(f"p{i}") for i in range(args.instances // 2)]
        for i, iid in enumerate(prefill):
            conductor.register(InstanceSpec(iid, Role.PREFILL, f"p{i}:1", "m", 64, 10**6, 64))
            conductor.heartbeat(iid, LoadReport(queued_requests=i % 3, queued_tokens=(i % 3) * 1000))
        for i in range(args.instances - len(prefill)):
            did = InstanceId(f"d{i}")
            conductor.register(InstanceSpec(did, Role.DECODE, f"d{i}:1", "m", 64, 10**7, 64))
            conductor.heartbeat(did, LoadReport(running_requests=i % 8, queued_tokens=1000 * (i % 8), free_kv_tokens=10**7))
        # Fill the index: prompt-length chains spread over instances and kvstore nodes.
        sources = [str(s) for s in prefill] + [f"kv{i}" for i in range(args.kvstores)]
        chains: list[list[BlockKey]] = []
        t0 = time.perf_counter()
        while len(conductor.index) < args.blocks:
            c = chain(rng, args.prompt_blocks)
            chains.append(c)
            for src in rng.sample(sources, 2):
                cut = rng.randint(1, len(c))
                conductor.publish(src, [BlockUpdate(True, k, Tier.HOST if src.startswith("kv") else Tier.ENGINE) for k in c[:cut]], False)
        fill_s = time.perf_counter() - t0
        lat, cpu = [], []
        for i in range(args.decisions):
            base = rng.choice(chains)
            keys = tuple(base[: rng.randint(1, len(base))]) + tuple(chain(rng, rng.randint(0, 8)))
            start, start_cpu = time.perf_counter(), time.thread_time()
            conductor.place(f"r{i}", "m", keys, len(keys) * 64 + 10, 128)
            lat.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
            if i % 32 == 0:  # heartbeats clear the placements the registry was counting
                for iid in prefill:
                    conductor.heartbeat(iid, LoadReport(queued_requests=1, queued_tokens=500))
        lat.sort()
        cpu.sort()
        out[policy] = {
            "p50_ms": round(lat[len(lat) // 2] * 1e3, 4),
            "p99_ms": round(lat[int(len(lat) * 0.99)] * 1e3, 4),
            "max_ms": round(lat[-1] * 1e3, 4),
            # CPU time of the deciding thread: excludes time the OS gave other processes.
            "cpu_p50_ms": round(cpu[len(cpu) // 2] * 1e3, 4),
            "cpu_p99_ms": round(cpu[int(len(cpu) * 0.99)] * 1e3, 4),
            "indexed_blocks": len(conductor.index),
            "fill_s": round(fill_s, 1),
        }
        del conductor
    out["max_rss_mb"] = round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024)
    out["pid"] = os.getpid()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
