"""``crescent up --aggregated 1 --model kimi-k3-nano``: the hybrid model (recurrent KDA state and
MLA) prefilled in chunks mixed into decode steps, replies equal to a single-process run — with
the preset's fp32 cache and with a bf16 one (``engine.kv_cache_dtype``)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.stack import Stack, start_stack, stop_stack
from tests.e2e.test_kimi_k3_path import (  # noqa: F401 (fixtures)
    BLOCK, CONTEXT, MODEL, UNLOCKED_K3_CARD, ask, cache_dtype, k3_reference, reference_reply, reply_text,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def k3_aggregated(tmp_path_factory: pytest.TempPathFactory, cache_dtype: str) -> Stack:
    env = {"CRESCENT_AGGREGATED__CHUNK_TOKENS": str(2 * BLOCK), "CRESCENT_AGGREGATED__ENGINE__THREADS": "1",
           "CRESCENT_AGGREGATED__ENGINE__KV_CACHE_DTYPE": cache_dtype,
           "CRESCENT_AGGREGATED__ENGINE__STATE_SNAPSHOT_EVERY_BLOCKS": "1",  # hits at any block (default: every 16th)
           "CRESCENT_GATEWAY__MODEL_POLICY": json.dumps(UNLOCKED_K3_CARD)}  # greedy replies: see test_kimi_k3_path
    running = start_stack(tmp_path_factory.mktemp("k3-aggregated"), "--aggregated", "1", "--model", MODEL,
                          "--block-size", str(BLOCK), "--kv-capacity-tokens", "2048", env=env)
    yield running
    stop_stack(running)


def test_concurrent_replies_equal_single_process_generation(k3_aggregated, k3_reference):
    conversations = [
        [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "Who keeps the log?"}],
        [{"role": "user", "content": "Describe the sea in one line."}],
        [{"role": "user", "content": "Name a colour."}],
    ]
    with ThreadPoolExecutor(len(conversations)) as pool:
        replies = list(pool.map(lambda m: ask(k3_aggregated, m, 12), conversations))
    for messages, reply in zip(conversations, replies):
        ids, out = reference_reply(k3_reference, messages, 12)
        assert reply.choices[0].message.content == reply_text(k3_reference, out), messages[-1]["content"]
        assert reply.usage.prompt_tokens == len(ids)


def test_a_shared_prefix_resumes_from_cached_state(k3_aggregated, k3_reference):
    first = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "What colour is the notebook?"}]
    second = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "What passes by?"}]
    ask(k3_aggregated, first, 2)
    reply = ask(k3_aggregated, second, 12)
    _, out = reference_reply(k3_reference, second, 12)
    assert reply.usage.prompt_tokens_details.cached_tokens >= 4 * BLOCK
    assert reply.choices[0].message.content == reply_text(k3_reference, out)
