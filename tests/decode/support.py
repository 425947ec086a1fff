"""Helpers for the decode tests: handed-off requests made by a real (tiny) prefill engine."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch

from crescent.services.common.metrics import engine_metrics
from crescent.services.decode.batcher import Batcher, DecodeRequest
from crescent.services.engine.engine import Engine
from crescent.services.engine.runtime import EngineWorker
from crescent.services.engine.sampler import SamplingConfig, sample_batch
from tests.engine.tiny_model import TINY, tiny_model

PAGE = 16
# A process registers one set of engine metric families (the role is a label value); tests of
# both roles share the set tests/prefill creates, or two sets would collide in the registry.
METRICS = engine_metrics("prefill")


def tiny_engine(capacity_tokens: int) -> Engine:
    torch.set_num_threads(1)
    return Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=capacity_tokens, page_size=PAGE)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def handed_off(prefill: Engine, request_id: str, tokens: list[int], max_tokens: int,
               sampling: SamplingConfig = SamplingConfig(), first_step: int = 0) -> DecodeRequest:
    """What a decode instance holds after prefill's handoff: prompt KV (host copies) + first token."""
    seq = prefill.add_sequence(request_id, tokens, use_cache=False)
    first = sample_batch(prefill.prefill(seq)[None], [sampling], [first_step])[0]
    payloads = [prefill.block_payload(seq, i, min(PAGE, len(tokens) - i * PAGE)).clone()
                for i in range(-(-len(tokens) // PAGE))]
    prefill.release(seq)
    return DecodeRequest(
        request_id=request_id, token_ids=tokens + [first], payloads=payloads, sampling=sampling,
        max_tokens=max_tokens, stop_token_ids=frozenset(), reserve_tokens=len(tokens) + max_tokens,
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
