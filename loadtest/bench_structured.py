#!/usr/bin/env python
"""Decode speed with and without a JSON-schema constraint, at batch 1 and 8; prints one JSON line.

Against a running Crescent (``--url``) or one it starts (``--start``). Each round streams the
same prompt constrained by a schema that forces about 120 tokens (an array of 40 integers),
then unconstrained with ``ignore_eos`` for as many tokens, one request alone and then 8 at once;
figures are medians over ``--rounds`` (rounds alternate, so drift on a noisy machine hits both).
It also replays each constrained output through the grammar engine in this process with the
model's tokenizer and reports the mask time per token (the engines compute it while the
forward runs, so it should not show in the decode figures).

  python loadtest/bench_structured.py --start
  python loadtest/bench_structured.py --url http://127.0.0.1:8000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_request_path import start_stack, stream  # noqa: E402

ITEMS = 40
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
          "minItems": ITEMS, "maxItems": ITEMS}
CONSTRAINED = {"response_format": {"type": "json_schema", "json_schema": {"name": "numbers", "schema": SCHEMA}}}


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Request {i}: list forty numbers between 0 and 999 as a JSON array."}]


def decode_rate(run: dict) -> float:
    return (run["completion_tokens"] - 1) / (run["end"] - run["first"])


def aggregate_rate(runs: list[dict]) -> float:
    """Tokens per second while all the streams were decoding at once."""
    start, end = max(r["first"] for r in runs), min(r["end"] for r in runs)
    arrived = sum(start < t <= end for r in runs for t in r["arrivals"])
    return arrived / (end - start) if end > start else float("nan")


def one_round(url: str, model: str, round_no: int) -> dict:
    constrained = stream(url, model, question(round_no), 256, extra=CONSTRAINED)
    tokens = constrained["completion_tokens"]
    free = stream(url, model, question(round_no), tokens, ignore_eos=True)
    with ThreadPoolExecutor(8) as pool:
        batch_c = list(pool.map(lambda i: stream(url, model, question(100 * round_no + i), 256, extra=CONSTRAINED),
                                range(8)))
    with ThreadPoolExecutor(8) as pool:
        batch_f = list(pool.map(lambda i: stream(url, model, question(100 * round_no + i), tokens, ignore_eos=True),
                                range(8)))
    for run in [constrained, *batch_c]:
        json.loads(run["text"])  # a constrained reply that is not JSON would make the figures meaningless
    return {"tokens": tokens, "texts": [constrained["text"], *(r["text"] for r in batch_c)],
            "b1_constrained": decode_rate(constrained), "b1_free": decode_rate(free),
            "b8_constrained": aggregate_rate(batch_c), "b8_free": aggregate_rate(batch_f)}


def mask_times(model: str, texts: list[str]) -> dict:
    """Per-token mask time of the grammar engine, replaying the constrained outputs in this process."""
    from crescent.protos import common_pb2
    from crescent.services.engine.constraints import ConstraintCompiler
    from crescent.services.model.kimi_tokenizer import tokenizer_for
    from crescent.services.model.model_source import resolve_model

    tokenizer = tokenizer_for(resolve_model(model))
    compiler = ConstraintCompiler.for_model(model, tokenizer.vocab_size, tokenizer.eos_token_ids)
    spec = common_pb2.Constraint(json_schema=json.dumps(SCHEMA))
    times = []
    for text in texts:
        constraint = compiler.compile(spec)
        assert constraint is not None
        for token in tokenizer.encode(text):
            start = time.perf_counter()
            constraint.allowed()
            times.append(time.perf_counter() - start)
            constraint.advance(token)
    times.sort()
    return {"mask_ms_median": round(statistics.median(times) * 1e3, 4),
            "mask_ms_p99": round(times[int(len(times) * 0.99)] * 1e3, 4), "mask_samples": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--start", action="store_true", help="start `crescent up` on a free port and stop it after")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    proc, url = None, args.url
    if args.start:
        proc, url = start_stack(Path(tempfile.mkdtemp(prefix="crescent-bench-")))
    try:
        stream(url, args.model, question(0), 4, extra=CONSTRAINED)  # warm-up: builds the engines' grammar tables
        rounds = [one_round(url, args.model, i + 1) for i in range(args.rounds)]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in rounds), 2)

    figures = {
        "tokens_per_reply": statistics.median(r["tokens"] for r in rounds),
        "decode_tok_s_batch1_free": median("b1_free"), "decode_tok_s_batch1_constrained": median("b1_constrained"),
        "decode_tok_s_batch8_free": median("b8_free"), "decode_tok_s_batch8_constrained": median("b8_constrained"),
        "overhead_batch1": round(1 - statistics.median(r["b1_constrained"] / r["b1_free"] for r in rounds), 3),
        "overhead_batch8": round(1 - statistics.median(r["b8_constrained"] / r["b8_free"] for r in rounds), 3),
        **mask_times(args.model, [t for r in rounds for t in r["texts"]]),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "cores": os.cpu_count(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
