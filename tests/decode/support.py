"""Helpers for the decode tests: handed-off requests made by a real (tiny) prefill engine."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch

from crescent.services.common.metrics import engine_metrics
from crescent.services.contract.choices import choice_seed
from crescent.services.decode.batcher import Batcher, Choice, DecodeRequest
from crescent.services.engine.engine import Engine
from crescent.services.instance.runtime import EngineWorker
from crescent.services.engine.sampler import SamplingConfig, sample_batch
from tests.engine.tiny_model import TINY, tiny_model

PAGE = 16
# A process registers one set of engine metric families (the role is a label value); tests of
# both roles share the set tests/prefill creates, or two sets would collide in the registry.
METRICS = engine_metrics("prefill")


def tiny_engine(capacity_tokens: int) -> Engine:
    torch.set_num_threads(1)
    return Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=capacity_tokens, block_size=PAGE)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def handed_off(prefill: Engine, request_id: str, tokens: list[int], max_tokens: int,
               sampling: SamplingConfig = SamplingConfig(), first_step: int = 0, n: int = 1) -> DecodeRequest:
    """What a decode instance holds after prefill's handoff: prompt KV (host copies) + first
    token(s); with ``n > 1``, choice i samples with ``choice_seed(seed, i)`` as prefill does."""
    seq = prefill.add_sequence(request_id, tokens, use_cache=False)
    logits = prefill.prefill(seq)[None]
    cfgs = [replace(sampling, seed=choice_seed(sampling.seed, i)) for i in range(n)]
    firsts = sample_batch(logits.repeat(n, 1), cfgs, [first_step] * n)
    payloads = [prefill.block_payload(seq, i, min(PAGE, len(tokens) - i * PAGE)).clone()
                for i in range(-(-len(tokens) // PAGE))]
    prefill.release(seq)
    return DecodeRequest(
        request_id=request_id, choices=[Choice(i, tokens + [first], cfg) for i, (first, cfg) in enumerate(zip(firsts, cfgs))],
        payloads=payloads, max_tokens=max_tokens, stop_token_ids=frozenset(), reserve_tokens=len(tokens) + max_tokens,
        first_step=first_step,
    )


async def read_all(request: DecodeRequest) -> tuple[list[int], str]:
    """Every token after the first, and how the request ended (what StreamTokens would send)."""
    tokens = []
    while True:
        update = await request.queue.get()
        tokens.extend(update.token_ids)
        if update.finish_reason is not None:
            return tokens, update.finish_reason


async def read_choices(request: DecodeRequest) -> dict[int, tuple[list[int], str]]:
    """Each choice's tokens after its first, and how it ended, until the request's last update."""
    out: dict[int, tuple[list[int], str]] = {}
    while True:
        update = await request.queue.get()
        tokens, _ = out.get(update.index, ([], ""))
        out[update.index] = (tokens + list(update.token_ids), update.finish_reason or "")
        if update.ends_request:
            return out


@asynccontextmanager
async def running_batcher(engine: Engine, max_batch_size: int = 16) -> AsyncIterator[Batcher]:
    """A batcher over ``engine`` with its worker on a thread of its own; stopped on exit."""
    worker = EngineWorker("test-decode")
    thread = threading.Thread(target=worker.serve_forever)
    thread.start()
    batcher = Batcher(engine, worker, max_batch_size=max_batch_size, unclaimed_timeout_s=60, metrics=METRICS)
    batcher.start()
    try:
        yield batcher
    finally:
        await batcher.stop()
        worker.shutdown()
        await asyncio.to_thread(thread.join)
