#!/usr/bin/env python
"""What mixing a prompt chunk into a decode step costs (``Engine.mixed_step``), in-process.

The case for an aggregated engine with chunked prefill (issue 15, item 2): instead of a prompt
stopping decode for its whole prefill, each decode step carries a chunk of it. For each chunk
size this prints the step time of ``--batch`` decoding sequences with the chunk mixed in, next
to the decode step alone plus the chunk alone (what two separate forwards cost), as medians
over ``--steps``. The ratio below 1 is what one forward saves; the mixed step time is the gap
between tokens a user sees while someone's prompt is prefilled.

  python loadtest/bench_mixed_step.py --batch 4 --chunks 0 64 128 256 512 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from crescent.services.engine.engine import Engine
from crescent.services.instance.runtime import build_engine
from crescent.services.engine.settings import EngineSettings


def tokens(engine: Engine, n: int, seed: int) -> list[int]:
    return torch.randint(10, engine.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decoding(engine: Engine, batch: int, context: int) -> list:
    seqs = []
    for i in range(batch):
        seq = engine.add_sequence(f"d{i}", tokens(engine, context, i), use_cache=False)
        seq.token_ids.append(int(torch.argmax(engine.prefill(seq))))
        seqs.append(seq)
    return seqs


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(engine: Engine, seqs: list, chunk: int, steps: int, prompt_tokens: int) -> tuple[float, float]:
    """Median mixed step, and median (decode step alone + chunk alone), in seconds."""
    mixed, separate = [], []
    for step in range(steps):
        prompt = engine.add_sequence(f"m{chunk}-{step}", tokens(engine, prompt_tokens, 1000 + step), use_cache=False)
        other = engine.add_sequence(f"s{chunk}-{step}", tokens(engine, prompt_tokens, 2000 + step), use_cache=False)
        chunks = [(prompt, chunk)] if chunk else []
        mixed.append(timed(lambda: engine.mixed_step(chunks, seqs)))
        for seq in seqs:  # the step's tokens, so the next step decodes the next position
            seq.token_ids.append(7)
        alone = timed(lambda: engine.decode_step(seqs))
        for seq in seqs:
            seq.token_ids.append(7)
        if chunk:
            alone += timed(lambda: engine.mixed_step([(other, chunk)], []))
        separate.append(alone)
        engine.release(prompt)
        engine.release(other)
    return statistics.median(mixed), statistics.median(separate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=512, help="decoding sequences' context")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 64, 128, 256, 512])
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engine = build_engine(EngineSettings(model=args.model, threads=args.threads, kv_capacity_tokens=32768))
    seqs = decoding(engine, args.batch, args.context)
    measure(engine, seqs, max(args.chunks), 2, max(args.chunks))  # warm-up
    print(f"{args.model}, {args.batch} decoding at context {args.context}, {args.threads} threads, "
          f"median of {args.steps} steps")
    print(f"{'chunk':>6} {'mixed step':>11} {'decode + chunk apart':>21} {'ratio':>6}")
    for chunk in args.chunks:
        mixed, separate = measure(engine, seqs, chunk, args.steps, max(chunk, 1))
        print(f"{chunk:>6} {mixed * 1000:>9.1f} ms {separate * 1000:>18.1f} ms {mixed / separate:>6.2f}")


if __name__ == "__main__":
    main()
