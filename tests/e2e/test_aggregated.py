"""``crescent up --aggregated 1``: one process prefills and decodes, prompts in chunks mixed into
decode steps, the KV never copied between roles. Replies are compared with the same model
generating in this process (greedy), as for the disaggregated path (test_request_path.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from crescent.services.model.model_source import DEFAULT_MODEL
from tests.e2e.stack import start_stack, stop_stack
from tests.e2e.test_request_path import LONG_CONTEXT, LONG_REPLY, QUESTIONS, _shared_prefix_blocks, reference_reply

pytestmark = pytest.mark.slow

CHUNK = 64  # small, so every prompt takes several steps, mixed with the others' decoding


@pytest.fixture(scope="module")
def aggregated(tmp_path_factory: pytest.TempPathFactory):
    env = {"CRESCENT_AGGREGATED__CHUNK_TOKENS": str(CHUNK), "CRESCENT_AGGREGATED__ENGINE__THREADS": "1"}
    running = start_stack(tmp_path_factory.mktemp("aggregated"), "--aggregated", "1", "--kv-capacity-tokens", "4096",
                          env=env)
    yield running
    stop_stack(running)


def ask(stack, messages: list[dict], max_tokens: int, **extra):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=180)
    return client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=max_tokens,
                                          temperature=0, **extra)


def test_one_aggregated_engine_serves_with_no_prefill_or_decode_process(aggregated):
    names = {s["name"] for s in aggregated.services}
    assert "aggregated-0" in names and not {"prefill-0", "decode-0"} & names
    health = httpx.get(f"{aggregated.url}/health", timeout=5).json()
    assert health["status"] == "ok" and health["prefill_instances"] == health["decode_instances"] == 1


def test_concurrent_long_and_short_prompts_equal_single_process_generation(aggregated, reference):
    # Short questions decode while a ~600-token prompt is computed 64 tokens per step beside them.
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    conversations.insert(3, [{"role": "system", "content": LONG_CONTEXT}, {"role": "user", "content": "Hours?"}])
    with ThreadPoolExecutor(len(conversations)) as pool:
        replies = list(pool.map(lambda m: ask(aggregated, m, 16), conversations))
    for messages, reply in zip(conversations, replies):
        ids, text, finish = reference_reply(reference, messages, 16)
        assert reply.choices[0].message.content == text, messages[-1]["content"]
        assert reply.choices[0].finish_reason == finish
        assert reply.usage.prompt_tokens == len(ids)
    # Decoded where it was prefilled: no KV crossed a handoff.
    assert aggregated.metric("aggregated-0", "crescent_engine_kv_transfer_bytes_total", {"direction": "handoff_out"}) == 0
    assert aggregated.metric("aggregated-0", "crescent_engine_kv_transfer_bytes_total", {"direction": "handoff_in"}) == 0


def test_n_choices_fork_the_prompt_prefilled_here(aggregated, reference):
    messages = [{"role": "user", "content": QUESTIONS[5]}]
    reply = ask(aggregated, messages, 12, n=3)
    _, text, _ = reference_reply(reference, messages, 12)
    assert [c.message.content for c in reply.choices] == [text] * 3  # greedy: every choice is the same


def test_a_shared_prefix_is_reused_from_the_engine_cache(aggregated, reference):
    first = [{"role": "system", "content": LONG_CONTEXT}, {"role": "user", "content": "Do gift cards expire?"}]
    second = [{"role": "system", "content": LONG_CONTEXT}, {"role": "user", "content": "When do you open on Sunday?"}]
    ask(aggregated, first, 4)
    reply = ask(aggregated, second, 20)
    first_ids, _, _ = reference_reply(reference, first, 1)
    second_ids, cold_text, _ = reference_reply(reference, second, 20)
    assert reply.usage.prompt_tokens_details.cached_tokens == _shared_prefix_blocks(first_ids, second_ids) >= 256
    assert reply.choices[0].message.content == cold_text


def test_a_client_that_leaves_mid_stream_gives_its_kv_back(aggregated, reference):
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": LONG_REPLY}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{aggregated.url}/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()  # held: a dropped line iterator closes the response (the client leaves)
            for _ in range(7):
                next(lines)  # the role, the first tokens; ~390 still to come
            held = aggregated.metric("aggregated-0", "crescent_engine_kv_used_tokens", {"role": "decode"})
            assert held > 0, "while it streams, its KV is held"
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: ask(aggregated, messages, 200), range(4)))
    _, text, _ = reference_reply(reference, messages, 200)
    assert all(r.choices[0].message.content == text for r in replies)
    # Nothing runs now: no page is held and nothing is promised (cached blocks are free to evict).
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        used = aggregated.metric("aggregated-0", "crescent_engine_kv_used_tokens", {"role": "decode"})
        if used == 0:
            break
        time.sleep(0.2)
    assert used == 0, f"{used} KV token slots still held after every request ended"
