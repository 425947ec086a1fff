"""Prefix-hit TTFT against snapshot memory on the tiny K3 (``kimi-k3-nano``), per snapshot policy.

A hybrid model resumes a prefix hit from the last KDA state snapshot at or below the match and
recomputes the rest, so where snapshots are kept decides how much of a hit is really a hit. This
drives the native engine (``Engine``, fp32, CPU) with the two prefix-sharing shapes of real
traffic, for each policy (``state_snapshot_every_blocks`` k, ``state_snapshots`` slots):

- *next turn*: a conversation's next prompt extends the previous one — it resumes at the previous
  prompt's last full block (a turn end, which every policy keeps);
- *same document, new question*: ``--docs`` documents of ``--doc-tokens`` tokens, each asked
  ``--questions`` different questions in turn (round robin over the documents) — the match ends
  inside the earlier prompt, below its turn end, so only a snapshot every k blocks helps.

Per policy: mean TTFT (the prefill's CPU time, ms, one thread) of the hits of each shape, the share of the
prompt taken from the cache, the snapshots written, and the pool's bytes — for the tiny model and,
scaled, for the full K3 (449 MB per snapshot: docs/k3.md, "Memory accounting").

    python loadtest/bench_k3_snapshot_ttft.py [--doc-tokens 2048] [--docs 4] [--questions 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels import triton; no kernel runs on CPU here

import torch  # noqa: E402

from crescent.services.engine.engine import Engine  # noqa: E402
from crescent.services.engine.kimi_k3.config import K3_FULL, NANO  # noqa: E402
from crescent.services.engine.kimi_k3.loading import seeded_weights  # noqa: E402
from crescent.services.engine.kimi_k3.memory import k3_footprint  # noqa: E402
from crescent.services.engine.kimi_k3.model import K3Model  # noqa: E402
from crescent.services.engine.kimi_k3.snapshots import SnapshotPolicy  # noqa: E402

# (every k blocks, slots): the old default (every block, 32 slots); 8 slots (the new default's pool)
# kept densely, sparsely (the new default: every 16th block), at turn ends only; then larger pools
POLICIES = [(1, 32), (1, 8), (16, 8), (0, 8), (16, 12), (4, 32), (16, 32), (0, 32)]
BLOCK = 64


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 150_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, prompt: list[int], name: str) -> tuple[float, int]:
    """(CPU seconds of the prompt's prefill — its TTFT on an idle machine —, tokens from the cache).
    CPU time, not wall time: the shared 2-core machines this runs on give wall times that swing
    10x with other work; one thread, so CPU time is the prefill's own time."""
    start = time.process_time()
    seq = engine.add_sequence(name, prompt)
    engine.prefill(seq)
    seconds = time.process_time() - start
    cached = seq.num_cached
    engine.release(seq)
    return seconds, cached


def bench(every: int, slots: int, args: argparse.Namespace, weights: dict) -> dict:
    model = K3Model(NANO, weights, snapshots=SnapshotPolicy(every_blocks=every, slots=slots))
    engine = Engine(model, model_id="nano", kv_capacity_tokens=1 << 17, block_size=BLOCK,
                    prefill_chunk_tokens=args.doc_tokens + 512, min_cached_prompt_tokens=0)
    docs = [tokens(args.doc_tokens, seed=d) for d in range(args.docs)]
    question = args.question_tokens
    turn_hits, doc_hits, cold = [], [], []
    for q in range(args.questions):
        for d, doc in enumerate(docs):
            first = doc + tokens(question, seed=1000 * q + d + 7)
            seconds, cached = run(engine, first, f"d{d}q{q}")
            (cold if q == 0 else doc_hits).append((seconds, cached / len(first)))
            follow = first + tokens(question, seed=5000 * q + d + 11)  # the conversation's next turn
            seconds, cached = run(engine, follow, f"d{d}q{q}t2")
            turn_hits.append((seconds, cached / len(follow)))
    fp = k3_footprint(NANO)

    def mean(rows: list[tuple[float, float]], i: int) -> float:
        return statistics.fmean(r[i] for r in rows) if rows else float("nan")

    return {"every_blocks": every, "slots": slots,
            "cold_ttft_ms": 1e3 * mean(cold, 0),
            "doc_hit_ttft_ms": 1e3 * mean(doc_hits, 0), "doc_hit_share": mean(doc_hits, 1),
            "turn_hit_ttft_ms": 1e3 * mean(turn_hits, 0), "turn_hit_share": mean(turn_hits, 1),
            "snapshots_taken": engine.cache.snapshots.taken, "snapshots_evicted": engine.cache.snapshots.evicted,
            "pool_bytes_nano": slots * fp.snapshot_bytes_per_block,
            "pool_bytes_k3": slots * k3_footprint(K3_FULL).snapshot_bytes_per_block}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--question-tokens", type=int, default=96)
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = seeded_weights(NANO, 0)
    rows = []
    with torch.inference_mode():
        run(Engine(K3Model(NANO, weights), model_id="warm", kv_capacity_tokens=4096, block_size=BLOCK),
            tokens(512, seed=99), "warm")
        for every, slots in POLICIES:
            rows.append(bench(every, slots, args, weights))
    print(f"{'every k':>8} {'slots':>5} {'cold ms':>8} {'doc-hit ms':>10} {'doc share':>9} {'turn ms':>8} "
          f"{'turn share':>10} {'taken':>6} {'evicted':>7} {'pool (nano)':>11} {'pool (K3)':>10}")
    for r in rows:
        print(f"{r['every_blocks']:>8} {r['slots']:>5} {r['cold_ttft_ms']:>8.0f} {r['doc_hit_ttft_ms']:>10.0f} "
              f"{r['doc_hit_share']:>9.2f} {r['turn_hit_ttft_ms']:>8.0f} {r['turn_hit_share']:>10.2f} "
              f"{r['snapshots_taken']:>6} {r['snapshots_evicted']:>7} "
              f"{r['pool_bytes_nano'] / 1e6:>9.2f}MB {r['pool_bytes_k3'] / 1e9:>8.1f}GB")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
