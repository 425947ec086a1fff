#!/usr/bin/env python
"""Prefill batching on and off (issue 15, item 4), against real prefill processes.

    .venv/bin/python loadtest/bench_prefill_batching.py [--prompts 8] [--tokens 500] [--rounds 2]

Starts one prefill process per setting of ``max_batch_tokens`` (0 = one prompt at a time, and
each value of ``--budgets``) with the default model and the torch threads ``crescent up`` would
give a lone prefill engine on this machine (``services/cpu_share.py``), plus a stand-in
scheduler. Each round sends ``--prompts`` concurrent cold prompts of ``--tokens`` random tokens
(a fresh cache salt per round, so nothing is a prefix hit) with ``max_tokens`` 1, so the call
ends at the first token and TTFT is the whole prefill. Rounds alternate between the processes
(only one is busy at a time). Prints, per setting, the median over rounds of the wall time, the
prompt-token throughput and the TTFT mean / median / max, the ratios against "off" and every
round's wall time (on a shared machine the spread is the noise; with ``--tokens`` near a budget,
that budget runs one prompt per forward, as "off" does, and is a control).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch

from crescent.protos import common_pb2, prefill_pb2, prefill_pb2_grpc
from crescent.services.cpu_share import available_cores, share_cores

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the real-process fixtures of tests/
from tests.decode.process import BLOCK, DecodeProcess, SchedulerStandIn  # noqa: E402

VOCAB = 49152  # the default model's (SmolLM2-135M)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(10, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def first_token_s(address: str, request_id: str, tokens: list[int], salt: bytes) -> float:
    """Seconds from sending the prompt to its first token."""
    start = time.perf_counter()
    with grpc.insecure_channel(address) as channel:
        for event in prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id=request_id, token_ids=tokens, cache_salt=salt,
                sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True)), timeout=300):
            if event.WhichOneof("event") == "first_token":
                return time.perf_counter() - start
    raise RuntimeError(f"{request_id}: no first token")


def round_of(address: str, prompts: list[list[int]], tag: str) -> tuple[float, list[float]]:
    """(wall seconds, TTFT of each prompt) for the prompts sent at once."""
    ttfts: list[float] = [0.0] * len(prompts)

    def send(i: int) -> None:
        ttfts[i] = first_token_s(address, f"{tag}-{i}", prompts[i], tag.encode())

    callers = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    return time.perf_counter() - start, ttfts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 2048], help="max_batch_tokens settings to compare with 0")
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped by ``timeout``: stop the processes too
    threads = share_cores(available_cores(), prefill=1)
    os.environ.update(threads.env("prefill"))
    scheduler = SchedulerStandIn()
    settings = [0, *args.budgets]
    processes: dict[int, DecodeProcess] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for budget in settings:
                run_dir = Path(tmp) / f"b{budget}"
                run_dir.mkdir()
                processes[budget] = DecodeProcess(run_dir, scheduler.address, 0, role="prefill", extra={
                    "max_batch_tokens": budget,
                    "engine": {"kv_capacity_tokens": 2 * args.prompts * (args.tokens + BLOCK), "block_size": BLOCK,
                               "threads": threads.prefill},
                })
                processes[budget].start()
                first_token_s(processes[budget].address, "warm-up", prompt(args.tokens, 0), b"warm-up")
            results: dict[int, list[tuple[float, list[float]]]] = {b: [] for b in settings}
            for r in range(args.rounds):
                prompts = [prompt(args.tokens, 1000 * r + i + 1) for i in range(args.prompts)]
                for budget in settings:
                    results[budget].append(round_of(processes[budget].address, prompts, f"r{r}-b{budget}"))
        finally:
            for process in processes.values():
                process.stop()
            scheduler.stop()

    total = args.prompts * args.tokens
    print(f"{args.prompts} concurrent cold prompts of {args.tokens} tokens, default model, {threads.prefill} torch "
          f"threads, {available_cores()} cores; median of {args.rounds} rounds")
    print(f"{'max_batch_tokens':>16} {'wall s':>7} {'tok/s':>7} {'TTFT mean':>9} {'p50':>6} {'max':>6}"
          f" {'tput ratio':>10} {'TTFT ratio':>10}  walls of the rounds")
    base = None
    for budget in settings:
        wall = statistics.median(w for w, _ in results[budget])
        mean = statistics.median(statistics.mean(t) for _, t in results[budget])
        p50 = statistics.median(statistics.median(t) for _, t in results[budget])
        worst = statistics.median(max(t) for _, t in results[budget])
        base = base or (wall, mean)
        print(f"{budget:>16} {wall:7.2f} {total / wall:7.0f} {mean:9.2f} {p50:6.2f} {worst:6.2f}"
              f" {base[0] / wall:10.2f} {mean / base[1]:10.2f}  {' '.join(f'{w:.1f}' for w, _ in results[budget])}")


if __name__ == "__main__":
    main()
