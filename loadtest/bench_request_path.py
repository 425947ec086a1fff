#!/usr/bin/env python
"""Speed of the whole request path, as a client sees it; prints one JSON line.

Measures, against any OpenAI-compatible server (Crescent's gateway, or a peer such as vLLM):
- cold TTFT of a ~2,000-token prompt nobody has sent before (median of --cold runs);
- warm TTFT: the same long prefix with a different final question (median of --warm runs);
- decode tokens/s of one request, and aggregate tokens/s of 8 concurrent ones.

  python loadtest/bench_request_path.py --start          # starts `crescent up` itself
  python loadtest/bench_request_path.py --url http://127.0.0.1:8000
  python loadtest/bench_request_path.py --url http://127.0.0.1:8100 --model /path/to/hf-dir   # a peer
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import httpx

from crescent.services.common.ports import unused_port

PARAGRAPH = (
    "The history of cartography spans thousands of years, from clay tablets in Mesopotamia to satellite "
    "imagery. Early maps mixed observation with myth; medieval mappae mundi placed Jerusalem at the centre; "
    "the age of exploration demanded accurate coastlines, and the problem of longitude drove the invention "
    "of the marine chronometer. Projections trade one distortion for another: Mercator keeps angles, "
    "equal-area projections keep sizes, and no flat map keeps both. "
)


def long_prompt(tokens: int, nonce: str) -> str:
    # ~88 tokens per paragraph for this vocabulary; the nonce makes every cold prompt new.
    return f"Session {nonce}. " + PARAGRAPH * max(1, tokens // 88)


def stream(url: str, model: str, messages: list[dict], max_tokens: int, ignore_eos: bool = False,
           extra: dict | None = None) -> dict:
    """One streamed request: first-token time, completion time, token count (``extra``: more body fields)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    if ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    first = None
    usage = {}
    arrivals = []  # when each content chunk arrived
    text: list[str] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text.extend(c["delta"].get("content") or "" for c in chunk.get("choices", []))
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
                first = first or arrivals[-1]
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "start": start, "first": first or end, "end": end, "arrivals": arrivals,
            "text": "".join(text),
            "completion_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "prompt_tokens": usage.get("prompt_tokens", 0)}


def measure(url: str, model: str, prompt_tokens: int, cold_runs: int, warm_runs: int, decode_tokens: int) -> dict:
    cold, warm, cached, prompt_lens = [], [], [], []
    for _ in range(cold_runs):
        context = long_prompt(prompt_tokens, uuid.uuid4().hex[:8])
        result = stream(url, model, [{"role": "system", "content": context},
                                     {"role": "user", "content": "Summarise this in one sentence."}], 8)
        cold.append(result["ttft"])
        prompt_lens.append(result["prompt_tokens"])
        for i in range(warm_runs // cold_runs or 1):
            result = stream(url, model, [{"role": "system", "content": context},
                                         {"role": "user", "content": f"Question {i}: which projection keeps angles?"}], 8)
            warm.append(result["ttft"])
            cached.append(result["cached_tokens"])

    question = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    single = stream(url, model, question, decode_tokens, ignore_eos=True)
    batch1 = (single["completion_tokens"] - 1) / (single["end"] - single["first"])
    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda i: stream(url, model, [{"role": "user", "content": f"Story {i}: a lighthouse keeper."}],
                                              decode_tokens, ignore_eos=True), range(8)))
    # Steady state: count the tokens that arrived while all eight were decoding.
    window_start = max(r["first"] for r in runs)
    window_end = min(r["end"] for r in runs)
    in_window = sum(window_start < t <= window_end for r in runs for t in r["arrivals"])
    batch8 = in_window / (window_end - window_start) if window_end > window_start else float("nan")
    return {
        "prompt_tokens": statistics.median(prompt_lens),
        "cold_ttft_s": round(statistics.median(cold), 3), "cold_ttft_runs": [round(x, 3) for x in cold],
        "warm_ttft_s": round(statistics.median(warm), 3), "warm_ttft_runs": [round(x, 3) for x in warm],
        "warm_cached_tokens": statistics.median(cached),
        "decode_tok_s_batch1": round(batch1, 2),
        "decode_tok_s_batch8_aggregate": round(batch8, 2),
    }


def start_stack(run_dir: Path) -> tuple[subprocess.Popen, str]:
    port = unused_port()
    proc = subprocess.Popen([sys.executable, "-m", "crescent.services.cli", "up", "--port", str(port),
                             "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (run_dir / "services.json").exists():
        if proc.poll() is not None:
            raise SystemExit(f"crescent up failed; logs in {run_dir}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--start", action="store_true", help="start `crescent up` on a free port and stop it after")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--cold", type=int, default=2, help="cold runs")
    parser.add_argument("--warm", type=int, default=4, help="warm runs")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--label", default="crescent")
    args = parser.parse_args()
    proc = None
    url = args.url
    if args.start:
        proc, url = start_stack(Path(tempfile.mkdtemp(prefix="crescent-bench-")))
    try:
        stream(url, args.model, [{"role": "user", "content": "warm-up"}], 4)
        figures = measure(url, args.model, args.prompt_tokens, args.cold, args.warm, args.decode_tokens)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    figures.update(label=args.label, machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
                   cores=__import__("os").cpu_count(), date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
