"""Crescent over vLLM, as a user meets it: the OpenAI API of a real gateway, a real scheduler and
kvstore, and aggregated instances whose engine is vLLM's CPU build (``engine.backend: vllm``),
all separate processes on loopback; beside them the session's standalone vLLM server on the same
weights (tests/engine_vllm/conftest.py).

vLLM starts in minutes on this machine, so the module starts its processes once and the tests
run in order on them (the last ones stop and replace the vLLM instance).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable

import httpx
import pytest
import torch

from crescent.services.engine.engine import Engine
from crescent.services.engine.llama import LlamaModel
from crescent.services.engine.loader import load_model
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.model.model_source import resolve_model
from tests.engine_vllm.vllm_stack import (
    BLOCK, MODEL, VLLM_START_S, ConcurrentStreams, VllmStack, assert_greedy_equals_the_peer, assert_reaped, cached, completion,
    prompt_ids, vllm_interpreter, wait_healthy,
)

# A test's time includes the module's vLLM starts (2-4 min each on a cold compile cache, more on busy cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(vllm_interpreter() is None, reason="make install-vllm first")]

MIGRATE_TOKENS = 160  # long enough on this CPU that a kill lands mid-stream


@pytest.fixture(scope="module")
def stack(vllm_stack: Callable[[dict[str, str]], VllmStack]) -> VllmStack:  # tests/engine_vllm/conftest.py
    return vllm_stack({"aggregated-0": "aggregated"})


def test_greedy_outputs_equal_a_standalone_vllm(stack: VllmStack) -> None:
    for words, nonce in ((20, "a1"), (320, "b2"), (720, "c3")):
        assert_greedy_equals_the_peer(stack, prompt_ids(words, nonce))


def test_a_streamed_reply_is_the_same_reply(stack: VllmStack) -> None:
    prompt = prompt_ids(150, "d4")
    whole = completion(stack.client(), prompt).choices[0].text
    streamed = "".join(c.choices[0].text for c in completion(stack.client(), prompt, stream=True) if c.choices)
    assert streamed == whole


def test_a_repeated_long_prompt_reuses_its_blocks(stack: VllmStack) -> None:
    prompt = prompt_ids(720, "e5")
    first = completion(stack.client(), prompt)
    again = completion(stack.client(), prompt)
    assert cached(first) == 0
    assert cached(again) >= (len(prompt) - 1) // BLOCK * BLOCK - BLOCK  # every full block but the last's
    assert again.choices[0].text == first.choices[0].text


def test_a_short_prompt_leaves_nothing_to_hit(stack: VllmStack) -> None:
    prompt = prompt_ids(180, "f6")  # 256 tokens or fewer: Kimi's rule, never cached
    assert len(prompt) <= 256
    completion(stack.client(), prompt)
    assert cached(completion(stack.client(), prompt)) == 0


def test_the_scheduler_indexes_what_vllm_caches(stack: VllmStack) -> None:
    completion(stack.client(), prompt_ids(720, "g7"))
    status = stack.instances()["aggregated-0"]
    assert status.info.kv_format.startswith("paged-v1:30x2x64x3x64")  # the native engine's block layout
    assert status.indexed_blocks >= 10, "vLLM's cached prompt blocks reach the Conductor's prefix index"
    health = httpx.get(stack.services["aggregated-0"].health, timeout=5).json()
    assert health.get("backend") == "vllm" or "vllm" in json.dumps(health)


async def test_stored_blocks_are_the_native_engines_kv(stack: VllmStack) -> None:
    """A block a vLLM instance stored is what the native engine computes for the same tokens (the
    same layout, RoPE convention and values within fp32 noise), so a mixed fleet shares blocks."""
    prompt = prompt_ids(400, "m1")
    completion(stack.client(), prompt, max_tokens=1)
    client = KvStoreClient(stack.services["kvstore"].grpc)
    try:
        found: KvBlock | None = None
        for _ in range(50):  # the connector's puts are in the background
            listed = await client.list_blocks()
            keys = [BlockKey(b.key) for b in listed.blocks] if listed is not None else []
            blocks = await client.get(keys, MODEL)
            found = next((b for b in blocks.values() if list(b.token_ids) == prompt[:BLOCK]), None)
            if found is not None:
                break
            await asyncio.sleep(0.1)
    finally:
        await client.close()
    assert found is not None, "the prompt's first block is in the kvstore"
    torch.set_num_threads(1)
    loaded = load_model(resolve_model(MODEL), progress=False)
    engine = Engine(LlamaModel(loaded.config, loaded.weights), model_id=MODEL, kv_capacity_tokens=1024,
                    block_size=BLOCK, min_cached_prompt_tokens=0)
    seq = engine.add_sequence("native", prompt[:2 * BLOCK])
    engine.prefill(seq)
    native = engine.block_payload(seq, 0)
    stored = torch.frombuffer(bytearray(found.payload), dtype=torch.float32).view(found.shape)
    assert tuple(found.shape) == tuple(native.shape)
    assert torch.allclose(stored, native, atol=2e-3, rtol=1e-3), (stored - native).abs().max()


def test_sampling_surface_reaches_vllm(stack: VllmStack) -> None:
    client = stack.client()
    prompt = prompt_ids(40, "h8")
    two = client.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=7, n=2, max_tokens=16)
    assert sorted(c.index for c in two.choices) == [0, 1]
    again = client.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=7, n=2, max_tokens=16)
    assert [c.text for c in sorted(two.choices, key=lambda c: c.index)] == \
           [c.text for c in sorted(again.choices, key=lambda c: c.index)], "a seed fixes every choice"
    one = completion(client, prompt, max_tokens=1)
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"
    lp = completion(client, prompt, logprobs=2, max_tokens=4).choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(top) >= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object with a name."}],
        response_format={"type": "json_object"}, max_tokens=40, temperature=0)
    text = chat.choices[0].message.content
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")
    pick = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sea wet?"}], max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert pick.choices[0].message.content in ("yes", "no"), "the engine enforces the choice"
    digits = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a number."}], max_tokens=12, temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{2}"}})
    assert re.fullmatch("[0-9]{3}-[0-9]{2}", digits.choices[0].message.content), "the engine enforces the regex"


def test_a_fresh_instance_loads_the_prefix_from_the_kvstore_and_only_for_its_tenant(stack: VllmStack) -> None:
    prompt = prompt_ids(720, "i9")
    first = completion(stack.client("acme"), prompt)
    # SIGTERM with a stream in flight: the instance drains it to its end, then exits 0.
    stream = completion(stack.client("acme"), prompt_ids(60, "j0"), max_tokens=MIGRATE_TOKENS, stream=True,
                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    assert stack.services["aggregated-0"].stop() == 0, "SIGTERM drains and exits cleanly"
    usage = None
    for chunk in chunks:
        text += chunk.choices[0].text if chunk.choices else ""
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == MIGRATE_TOKENS, "the drained stream ran to its end"

    fresh = stack.start_engine("aggregated-1", "aggregated")
    wait_healthy([fresh], VLLM_START_S)
    again = completion(stack.client("acme"), prompt)
    assert cached(again) >= 10 * BLOCK, "the blocks came from the kvstore: this vLLM process never saw the prompt"
    assert again.choices[0].text == first.choices[0].text
    other = completion(stack.client("globex"), prompt)
    assert cached(other) == 0, "another tenant never loads acme's blocks"
    assert other.choices[0].text == first.choices[0].text


def test_kill_9_of_a_vllm_instance_migrates_its_streams(stack: VllmStack) -> None:
    second = stack.start_engine("aggregated-2", "aggregated")
    wait_healthy([second], VLLM_START_S)
    prompts = [prompt_ids(60, f"k{i}") for i in range(3)]
    ignore_eos = {"extra_body": {"ignore_eos": True}}
    reference = [completion(stack.client(), p, max_tokens=MIGRATE_TOKENS, **ignore_eos).choices[0].text
                 for p in prompts]
    streams = ConcurrentStreams(stack.client, prompts, MIGRATE_TOKENS)
    streams.start(timeout_s=120)
    load = {name: status.load.running_requests for name, status in stack.instances().items()}
    victim = max(("aggregated-1", "aggregated-2"), key=lambda name: load.get(name, 0))
    orphans = stack.kill_9(victim)
    streams.check(reference)
    assert_reaped(orphans)
