#!/usr/bin/env python
"""Tokens per second of one engine instance as one process and as a tensor-parallel group.

The leader runs here (``build_engine`` with ``engine.parallel``, as a server would); its
workers are ``run_worker`` processes on loopback, one torch thread each. For each group size it
times a prompt's prefill (prompt tokens/s) and greedy decode steps of ``--batch`` sequences
(generated tokens/s), medians over ``--repeats``. On a machine with fewer cores than ranks the
group only adds its all-reduces (two per layer per forward) and the batch broadcast: it shows
the cost of the group, not a speed-up; a speed-up needs a core (or a GPU) per rank.

  python loadtest/bench_tensor_parallel.py --sizes 1 3 --prompt 512 --batch 1 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from crescent.services.engine.engine import Engine
from crescent.services.instance.runtime import build_engine
from crescent.services.engine.settings import EngineSettings
from crescent.services.model.model_source import DEFAULT_MODEL

WORKER = ("import json, sys; from crescent.services.engine.parallel.worker import run_worker; "
          "from crescent.services.engine.settings import EngineSettings; "
          "run_worker(EngineSettings.model_validate(json.loads(sys.argv[1])))")


def settings(model: str, size: int, rank: int, port: int, threads: int) -> EngineSettings:
    return EngineSettings.model_validate({
        "model": model, "kv_capacity_tokens": 16384, "block_size": 64, "threads": threads,
        "min_cached_prompt_tokens": 0, "parallel": {"group_size": size, "rank": rank, "port": port}})


def prompt(engine: Engine, n: int, seed: int) -> list[int]:
    return torch.randint(10, engine.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def measure(engine: Engine, prompt_tokens: int, batches: list[int], steps: int, repeats: int) -> dict[str, float]:
    out: dict[str, float] = {}
    times = []
    for r in range(repeats):
        seq = engine.add_sequence("p", prompt(engine, prompt_tokens, r), use_cache=False)
        start = time.perf_counter()
        engine.prefill(seq)
        times.append(time.perf_counter() - start)
        engine.release(seq)
    out["prefill_tok_s"] = prompt_tokens / statistics.median(times)
    for batch in batches:
        seqs = [engine.add_sequence(f"d{i}", prompt(engine, 128, 100 + i), use_cache=False) for i in range(batch)]
        for seq in seqs:
            seq.token_ids.append(int(torch.argmax(engine.prefill(seq))))
        step_times = []
        for _ in range(steps):
            start = time.perf_counter()
            logits = engine.decode_step(seqs)
            step_times.append(time.perf_counter() - start)
            for seq, row in zip(seqs, logits):
                seq.token_ids.append(int(torch.argmax(row)))
        out[f"decode_b{batch}_tok_s"] = batch / statistics.median(step_times)
        for seq in seqs:
            engine.release(seq)
    return out


def run(model: str, size: int, port: int, threads: int, args: argparse.Namespace) -> dict[str, float]:
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, settings(model, size, rank, port, 1).model_dump_json()])
               for rank in range(1, size)]
    try:
        engine = build_engine(settings(model, size, 0, port, threads), progress=False)
        result = measure(engine, args.prompt, args.batch, args.steps, args.repeats)
        if size > 1:
            engine.model.group.close()
        for worker in workers:
            worker.wait(30)
        return result
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of a one-process run (ranks: 1 each)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    for size in args.sizes:
        # A group is set up once per process (torch.distributed's default group): one size per run.
        if size > 1 and len(args.sizes) > 1:
            code = subprocess.run([sys.executable, __file__, "--model", args.model, "--sizes", str(size),
                                   "--prompt", str(args.prompt), "--batch", *map(str, args.batch),
                                   "--steps", str(args.steps), "--repeats", str(args.repeats), "--port", str(args.port)],
                                  check=False).returncode
            if code:
                sys.exit(code)
            continue
        threads = args.threads if size == 1 else 1
        result = run(args.model, size, args.port, threads, args)
        print(json.dumps({"model": args.model, "group_size": size, "threads_per_rank": threads,
                          **{k: round(v, 1) for k, v in result.items()}}), flush=True)


if __name__ == "__main__":
    main()
