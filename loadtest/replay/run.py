"""Sending a trace open loop with the OpenAI client, and the report of one run."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.replay.prompts import (
    build_prompt,
    parse_reason,
    percentile,
    scaled_input_words,
    scaled_output,
    theoretical_cached_fraction,
    time_scale_for_rate,
)
from crescent.services.contract.latency import tbt_seconds
from loadtest.simulator.trace import TraceRequest, rescale


@dataclass
class Outcome:
    index: int
    arrival_s: float
    ok: bool = False
    status: str = ""  # HTTP status of a failure, or "connection" / "timeout" / "unfinished"
    reason: str = ""
    ttft_s: float | None = None
    tbt_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    max_tokens: int = 0     # output tokens asked for (the trace's, scaled)
    prompt_words: int = 0   # words sent (the trace's input, scaled): the prompt size of a request cut off before its usage
    token_times: list[float] = field(default_factory=list, repr=False)


@dataclass
class ReplayConfig:
    url: str
    model: str | None = None
    api: str = "chat"  # or "completions"
    tokens_per_block: int = 16
    output_scale: float = 32.0
    time_scale: float = 1.0
    rate: float | None = None
    max_requests: int | None = 100
    max_seconds: float = 600.0
    ttft_slo: float = 10.0
    tbt_slo: float = 1.0
    seed: int = 0
    request_timeout: float = 600.0


async def _one(client, cfg: ReplayConfig, model: str, req: TraceRequest, t0: float, out: Outcome) -> None:
    import openai

    prompt = build_prompt(req, cfg.tokens_per_block, cfg.seed)
    common = dict(
        model=model, max_tokens=scaled_output(req, cfg.output_scale), temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    sent = time.perf_counter()
    times: list[float] = []
    try:
        if cfg.api == "chat":
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices or ():
                text = choice.delta.content if cfg.api == "chat" else choice.text
                if text:
                    times.append(now)
            usage = getattr(chunk, "usage", None)
            if usage:
                out.prompt_tokens = usage.prompt_tokens or 0
                out.output_tokens = usage.completion_tokens or 0
                details = getattr(usage, "prompt_tokens_details", None)
                out.cached_tokens = (getattr(details, "cached_tokens", None) or 0) if details else 0
        done = time.perf_counter()
        if not times and out.output_tokens > 0:
            # Generated tokens with no visible text (e.g. a single ignored end-of-sequence token,
            # which detokenizes to nothing): completed; TTFT bounded by the end of the stream.
            times.append(done)
        out.ok = bool(times)
        if not times:
            out.status, out.reason = "empty", "no tokens"
        else:
            out.ttft_s = times[0] - sent
            out.latency_s = done - sent
            out.tbt_s = tbt_seconds([b - a for a, b in zip(times, times[1:])])
            out.output_tokens = out.output_tokens or len(times)
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        err = body.get("error") if isinstance(body.get("error"), dict) else body
        out.status, out.reason = str(exc.status_code), parse_reason(str(err.get("message") or exc.message))
    except openai.APITimeoutError:
        out.status, out.reason = "timeout", "client timeout"
    except openai.APIConnectionError as exc:
        out.status, out.reason = "connection", type(exc.__cause__ or exc).__name__
    except asyncio.CancelledError:
        out.status, out.reason = "unfinished", "cut off by --max-seconds"
        raise
    finally:
        out.token_times = [t - t0 for t in times]


async def resolve_model(client) -> str:
    models = await client.models.list()
    return models.data[0].id


async def replay(cfg: ReplayConfig, trace: Sequence[TraceRequest], progress=None) -> dict:
    """Send ``trace`` (already limited) open loop; return the report."""
    import httpx
    import openai

    scale = time_scale_for_rate(trace, cfg.rate) if cfg.rate else cfg.time_scale
    reqs = rescale(trace, scale)
    first = reqs[0].arrival_s if reqs else 0.0
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=10_000, max_keepalive_connections=1_000),
                             timeout=httpx.Timeout(cfg.request_timeout, connect=30.0))
    client = openai.AsyncOpenAI(base_url=cfg.url.rstrip("/") + "/v1", api_key="replay", max_retries=0, http_client=http)
    model = cfg.model or await resolve_model(client)
    outcomes = [Outcome(r.index, r.arrival_s - first, max_tokens=scaled_output(r, cfg.output_scale),
                        prompt_words=scaled_input_words(r, cfg.tokens_per_block)) for r in reqs]
    task_id = progress.add_task(f"{cfg.url} x{scale:g}", total=len(reqs)) if progress else None
    t0 = time.perf_counter()
    deadline = t0 + cfg.max_seconds

    async def fire(req: TraceRequest, out: Outcome) -> None:
        delay = t0 + out.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            await _one(client, cfg, model, req, t0, out)
        finally:
            if progress:
                progress.advance(task_id)

    tasks = [asyncio.create_task(fire(r, o)) for r, o in zip(reqs, outcomes) if o.arrival_s <= cfg.max_seconds]
    skipped = len(reqs) - len(tasks)
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - t0
    await client.close()
    report = summarize(outcomes[: len(tasks)], cfg, trace[: len(tasks)], scale, wall)
    report["not_sent"] = skipped
    report["model"] = model
    return report


def summarize(outcomes: Sequence[Outcome], cfg: ReplayConfig, trace: Sequence[TraceRequest], scale: float, wall_s: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft_s for o in ok]
    tbt = [o.tbt_s for o in ok if o.tbt_s is not None]
    n = len(outcomes)

    def meets_ttft(o: Outcome) -> bool:
        return o.ok and o.ttft_s <= cfg.ttft_slo

    def meets_tbt(o: Outcome) -> bool:
        return o.ok and (o.tbt_s is None or o.tbt_s <= cfg.tbt_slo)

    prompt = sum(o.prompt_tokens for o in ok)
    span = (outcomes[-1].arrival_s - outcomes[0].arrival_s) if n > 1 else 0.0
    return {
        "url": cfg.url, "api": cfg.api, "requests": n, "completed": len(ok), "failed": n - len(ok),
        "rejections": dict(Counter(f"{o.status} {o.reason}" for o in outcomes if not o.ok)),
        "time_scale": scale, "offered_rps": (n - 1) / span if span > 0 else None, "wall_s": wall_s,
        "ttft_s": {f"p{p}": percentile(ttft, p) for p in (50, 90, 99)} | {"mean": sum(ttft) / len(ttft) if ttft else None},
        "tbt_s": {f"p{p}": percentile(tbt, p) for p in (50, 90, 99)} | {"mean": sum(tbt) / len(tbt) if tbt else None},
        "ttft_slo_s": cfg.ttft_slo, "tbt_slo_s": cfg.tbt_slo,
        "ttft_attainment": sum(map(meets_ttft, outcomes)) / n if n else None,
        "tbt_attainment": sum(map(meets_tbt, outcomes)) / n if n else None,
        "effective_capacity": sum(meets_ttft(o) and meets_tbt(o) for o in outcomes) / n if n else None,
        "output_tokens": sum(o.output_tokens for o in ok), "prompt_tokens": prompt,
        "cached_fraction": sum(o.cached_tokens for o in ok) / prompt if prompt else None,
        "theoretical_cached_fraction": theoretical_cached_fraction(trace, cfg.tokens_per_block),
        "tokens_per_block": cfg.tokens_per_block, "output_scale": cfg.output_scale, "seed": cfg.seed,
        "per_request": [  # for comparing with the simulator request by request
            {"index": o.index, "arrival_s": round(o.arrival_s, 4), "ok": o.ok, "status": o.status, "reason": o.reason,
             "ttft_s": o.ttft_s, "tbt_s": o.tbt_s, "output_tokens": o.output_tokens, "prompt_tokens": o.prompt_tokens,
             "cached_tokens": o.cached_tokens, "max_tokens": o.max_tokens, "prompt_words": o.prompt_words}
            for o in outcomes
        ],
    }
