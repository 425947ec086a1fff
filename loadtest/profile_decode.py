#!/usr/bin/env python
"""Where a decode step's time goes, in-process (no gRPC, no HTTP): issue 15's "profile first".

Builds the engine as a decode instance does, prefills ``--batch`` prompts of ``--context``
tokens, then times ``--steps`` decode steps (forward + sampling) and prints tokens/s per batch
size, the share of the step spent in the forward pass, in building the batch and in sampling,
and torch's profiler table of the ops with the most self time.

  python loadtest/profile_decode.py --batch 1 8 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from crescent.services.engine.engine import Engine
from crescent.services.engine.llama import ForwardBatch
from crescent.services.instance.runtime import build_engine
from crescent.services.engine.sampler import SamplingConfig, sample_batch
from crescent.services.engine.settings import EngineSettings


def prefilled(engine: Engine, batch: int, context: int) -> list:
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(batch):
        tokens = torch.randint(10, engine.config.vocab_size, (context,), generator=gen).tolist()
        seq = engine.add_sequence(f"s{i}", tokens, use_cache=False)
        seq.token_ids.append(int(torch.argmax(engine.prefill(seq))))
        seqs.append(seq)
    return seqs


def timed_steps(engine: Engine, seqs: list, steps: int) -> dict[str, float]:
    cfgs = [SamplingConfig(temperature=0.8, seed=i) for i in range(len(seqs))]
    build = forward = sample = 0.0
    build_batch = ForwardBatch.build

    def timed_build(*args, **kwargs):
        nonlocal build
        t = time.perf_counter()
        out = build_batch(*args, **kwargs)
        build += time.perf_counter() - t
        return out

    ForwardBatch.build = staticmethod(timed_build)  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        for step in range(steps):
            t = time.perf_counter()
            with torch.inference_mode():
                logits = engine.decode_step(seqs)
            forward += time.perf_counter() - t
            t = time.perf_counter()
            tokens = sample_batch(logits, cfgs, [step] * len(seqs), [s.token_ids for s in seqs])
            sample += time.perf_counter() - t
            for seq, token in zip(seqs, tokens):
                seq.token_ids.append(token)
        total = time.perf_counter() - start
    finally:
        ForwardBatch.build = staticmethod(build_batch)  # type: ignore[method-assign]
    return {"tok_s": round(steps * len(seqs) / total, 1), "step_ms": round(1000 * total / steps, 2),
            "forward_share": round((forward - build) / total, 3), "build_share": round(build / total, 3),
            "sample_share": round(sample / total, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--table", type=int, default=15, help="profiler rows to print (0: none)")
    args = parser.parse_args()
    engine = build_engine(EngineSettings(threads=args.threads, kv_capacity_tokens=(args.context + 256) * max(args.batch)),
                          progress=False)
    for batch in args.batch:
        seqs = prefilled(engine, batch, args.context)
        timed_steps(engine, seqs, 4)  # warm-up
        figures = timed_steps(engine, seqs, args.steps)
        print(json.dumps({"batch": batch, "context": args.context, "threads": args.threads, **figures}))
        if args.table:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                timed_steps(engine, seqs, 8)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.table))
        for seq in seqs:
            engine.release(seq)


if __name__ == "__main__":
    main()
