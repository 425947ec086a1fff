#!/usr/bin/env python
"""Prefill beside decode on one machine: what a long prompt costs the streams already decoding.

Against a running server (Crescent or any OpenAI-compatible peer): ``--streams`` requests
decode ``--decode-tokens`` tokens each; meanwhile a prompt of about ``--prompt-words`` words
(a new one every trial, so no cache hit) is sent with ``max_tokens`` 1. Prints, per trial, that
prompt's TTFT and the gaps between the decoding streams' tokens (p50 and max): a stall there is
what a user streaming an answer sees when someone else's long prompt arrives. ``--solo`` first
measures each alone (the prompt's TTFT with nothing decoding, and the gaps with no prompt).

  python loadtest/bench_contention.py --url http://127.0.0.1:8000 --solo
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                 gaps: list[float] | None = None) -> float:
    """Stream one completion; return its TTFT and append its inter-token gaps to ``gaps``."""
    start = time.perf_counter()
    first = last = None
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or "[DONE]" in line:
                continue
            now = time.perf_counter()
            if first is None:
                first = now - start
            elif gaps is not None:
                gaps.append(now - last)
            last = now
    assert first is not None, "no token came back"
    return first


def long_prompt(words: int) -> str:
    # A fresh prefix every call: the prompt is never a cache hit.
    return f"trial {time.time_ns()} " + " ".join(f"word{i}" for i in range(words))


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


async def main(args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        model = args.model or (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        if args.solo:
            ttfts = [await stream(client, args.url, model, long_prompt(args.prompt_words), 1) for _ in range(3)]
            gaps: list[float] = []
            await asyncio.gather(*(stream(client, args.url, model, f"Tell me a story, number {k}.",
                                          args.decode_tokens, gaps) for k in range(args.streams)))
            print(f"alone: prompt TTFT median {statistics.median(ttfts):.2f} s; "
                  f"{args.streams} streams' gap p50 {ms(statistics.median(gaps))}, max {ms(max(gaps))}")
        for trial in range(args.trials):
            gaps = []
            streams = [asyncio.create_task(stream(client, args.url, model, f"Tell me a story, number {trial}-{k}.",
                                                  args.decode_tokens, gaps)) for k in range(args.streams)]
            await asyncio.sleep(args.delay_s)  # the streams are decoding by now
            ttft = await stream(client, args.url, model, long_prompt(args.prompt_words), 1)
            await asyncio.gather(*streams)
            print(f"trial {trial}: prompt TTFT {ttft:.2f} s; gaps p50 {ms(statistics.median(gaps))}, "
                  f"max {ms(max(gaps))}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="", help="default: the server's first model")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=150)
    parser.add_argument("--prompt-words", type=int, default=300, help="~900 tokens with SmolLM2's tokenizer")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--delay-s", type=float, default=2.0)
    parser.add_argument("--solo", action="store_true", help="first measure each alone")
    asyncio.run(main(parser.parse_args()))
