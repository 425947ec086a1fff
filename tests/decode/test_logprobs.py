"""Decode reports each token's log-probabilities, batched with other requests, as one process would.

The reference runs the same tiny model alone in this process and takes ``log_softmax`` of each
step's logits; requests that asked get one entry per token equal to it (whatever shares their
batch), requests that did not ask get none.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from crescent.services.engine.sampler import SamplingConfig
from tests.decode.support import PAGE, handed_off, prompt, running_batcher, tiny_engine


def reference(tokens: list[int], max_tokens: int) -> list[tuple[int, float, list[int]]]:
    """(token, its log-probability, the 3 most likely ids) per greedy step after the first."""
    engine = tiny_engine(64 * PAGE)
    seq = engine.add_sequence("ref", tokens, use_cache=False)
    logits = engine.prefill(seq)
    out = []
    for step in range(max_tokens):
        token = int(torch.argmax(logits))
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if step:  # the first token is prefill's
            out.append((token, float(logprobs[token]), torch.topk(logprobs, 3).indices.tolist()))
        seq.token_ids.append(token)
        logits = engine.decode_step([seq])[0]
    return out


def test_requests_that_ask_get_the_single_process_log_softmax_per_token() -> None:
    prefill, decode = tiny_engine(64 * PAGE), tiny_engine(64 * PAGE)
    prompts = [prompt(18 + 5 * i, seed=40 + i) for i in range(4)]
    asks = [SamplingConfig(logprobs=3), SamplingConfig(), SamplingConfig(logprobs=3), SamplingConfig(logprobs=0)]
    max_tokens = 10

    async def scenario():
        async with running_batcher(decode) as batcher:
            requests = [handed_off(prefill, f"lp{i}", t, max_tokens, sampling=s)
                        for i, (t, s) in enumerate(zip(prompts, asks))]
            for request in requests:
                batcher.accept(request)
            updates = []
            for request in requests:
                got = []
                while True:
                    update = await request.queue.get()
                    got.append(update)
                    if update.finish_reason is not None:
                        break
                updates.append(got)
            return updates

    updates = asyncio.run(scenario())
    for tokens, sampling, got in zip(prompts, asks, updates):
        ids = [t for u in got for t in u.token_ids]
        entries = [e for u in got for e in u.logprobs]
        expected = reference(tokens, max_tokens)
        assert ids == [t for t, _, _ in expected]
        if sampling.logprobs is None:
            assert entries == []
            continue
        assert [e.token_id for e in entries] == ids
        assert [e.logprob for e in entries] == pytest.approx([lp for _, lp, _ in expected], abs=1e-4)
        assert [[t for t, _ in e.top] for e in entries] == [top[: sampling.logprobs] for _, _, top in expected]
