"""Prefill and decode pools on vLLM, as a user meets them: the OpenAI API of a real gateway,
scheduler and kvstore, one vLLM prefill and two vLLM decode instances (``engine.backend: vllm``),
each prompt's KV handed from prefill to decode through the kvstore; beside them the session's
standalone vLLM server on the same weights (tests/engine_vllm/conftest.py). Separate processes
on loopback, started once for the module; the tests run in order (the last ones kill and drain
decode instances).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests.engine_vllm.vllm_stack import (
    BLOCK, MODEL, ConcurrentStreams, VllmStack, assert_greedy_equals_the_peer, assert_reaped, cached, completion, prompt_ids,
    vllm_interpreter,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(vllm_interpreter() is None, reason="make install-vllm first")]

STREAM_TOKENS = 160  # long enough on this CPU that a kill lands mid-stream
DECODES = ("decode-0", "decode-1")


@pytest.fixture(scope="module")
def stack(vllm_stack: Callable[[dict[str, str]], VllmStack]) -> VllmStack:  # tests/engine_vllm/conftest.py
    return vllm_stack({"prefill-0": "prefill", **{name: "decode" for name in DECODES}})


def test_greedy_outputs_equal_a_standalone_vllm(stack: VllmStack) -> None:
    for words, nonce in ((20, "a1"), (200, "b2"), (720, "c3")):
        prompt = prompt_ids(words, nonce)
        text = assert_greedy_equals_the_peer(stack, prompt)
        streamed = "".join(c.choices[0].text for c in completion(stack.client(), prompt, stream=True) if c.choices)
        assert streamed == text


def test_decode_loads_the_prompt_from_the_kvstore(stack: VllmStack) -> None:
    for words, nonce in ((180, "d4"), (720, "e5")):  # a private short prompt (one-time salt) and a tenant's
        prompt = prompt_ids(words, nonce)
        before = stack.kvstore_hits()
        first = completion(stack.client(), prompt)
        loaded = stack.kvstore_hits() - before
        assert loaded >= (len(prompt) - 1) // BLOCK, f"{len(prompt)} tokens: decode computed what prefill handed over"
        assert cached(first) == 0
    again = completion(stack.client(), prompt)
    assert cached(again) >= (len(prompt) - 1) // BLOCK * BLOCK - BLOCK, "prefill reuses its cached prefix"
    assert again.choices[0].text == first.choices[0].text
    assert cached(completion(stack.client("globex"), prompt)) == 0, "never across tenants"
    short = prompt_ids(180, "d4")
    assert cached(completion(stack.client(), short)) == 0, "a prompt of 256 tokens or fewer is never a hit"


def test_the_scheduler_indexes_the_prefill_cache(stack: VllmStack) -> None:
    completion(stack.client(), prompt_ids(720, "f6"), max_tokens=1)
    statuses = stack.instances()
    assert statuses["prefill-0"].info.kv_format.startswith("paged-v1:30x2x64x3x64")
    assert statuses["prefill-0"].indexed_blocks >= 10, "vLLM's cached prompt blocks reach the prefix index"
    assert set(DECODES) <= set(statuses)


def test_sampling_surface_on_the_pools(stack: VllmStack) -> None:
    client = stack.client()
    prompt = prompt_ids(40, "g7")
    two = client.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=7, n=2, max_tokens=16)
    again = client.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=7, n=2, max_tokens=16)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert [c.text for c in sorted(two.choices, key=lambda c: c.index)] == \
           [c.text for c in sorted(again.choices, key=lambda c: c.index)], "a seed fixes every choice"
    peer = stack.peer().completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=7, max_tokens=16)
    one = client.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=7, max_tokens=16)
    assert one.choices[0].text == peer.choices[0].text, "decode samples the whole sequence: seeds match vLLM's"
    single = completion(client, prompt, max_tokens=1)
    assert single.usage.completion_tokens == 1 and single.choices[0].finish_reason == "length"
    lp = completion(client, prompt, logprobs=2, max_tokens=4).choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(top) >= 2 for top in lp.top_logprobs)
    digits = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a number."}], max_tokens=12, temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{2}"}})
    assert re.fullmatch("[0-9]{3}-[0-9]{2}", digits.choices[0].message.content), "the engine enforces the regex"


def test_kill_9_of_a_vllm_decode_migrates_its_streams_and_sigterm_drains(stack: VllmStack) -> None:
    prompts = [prompt_ids(60, f"k{i}") for i in range(3)]
    ignore_eos = {"extra_body": {"ignore_eos": True}}
    reference = [completion(stack.peer(), p, max_tokens=STREAM_TOKENS, **ignore_eos).choices[0].text for p in prompts]
    streams = ConcurrentStreams(stack.client, prompts, STREAM_TOKENS)
    streams.start()
    load = {name: status.load.running_requests for name, status in stack.instances().items()}
    victim = max(DECODES, key=lambda name: load.get(name, 0))
    assert load[victim] > 0
    orphans = stack.kill_9(victim)
    streams.check(reference)
    assert_reaped(orphans)

    # SIGTERM of the decode left, a stream in flight: it drains to its end, then exits 0.
    survivor = next(name for name in DECODES if name != victim)
    stream = completion(stack.client(), prompt_ids(60, "m1"), max_tokens=STREAM_TOKENS, stream=True,
                        stream_options={"include_usage": True}, **ignore_eos)
    chunks = iter(stream)
    next(chunks)
    assert stack.services[survivor].stop() == 0, "SIGTERM drains and exits cleanly"
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == STREAM_TOKENS, "the drained stream ran to its end"
