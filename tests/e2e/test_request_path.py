"""The whole request path through real processes: gateway → scheduler → prefill → kvstore → decode.

Every reply is compared with the same model generating in this process (greedy), so a wrong KV
handoff, a bad cached block or batching noise shows up as different text.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from crescent.services.model.model_source import DEFAULT_MODEL

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Why is the sky blue? Answer in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name a famous physicist.",
    "Give me a synonym for 'happy'.",
]

LONG_CONTEXT = (
    "You are the support assistant of Crescent Hardware. Store policy: returns are accepted within 30 days "
    "with a receipt; power tools carry a two-year warranty; garden tools carry a one-year warranty; "
    "orders over 50 dollars ship free; the store opens at 8 am and closes at 8 pm on weekdays, 9 am to 5 pm "
    "on weekends; gift cards never expire; price matching applies to local competitors only. "
) * 4


# Greedy, the default model counts "1. 1\n2. 2\n..." for hundreds of tokens: a stream still running
# when a test looks. ("Count from one to five hundred." gets a 19-token answer about disasters.)
LONG_REPLY = "Count from 1 to 500, separated by commas."


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def reference_reply(reference, messages: list[dict], max_tokens: int) -> tuple[list[int], str, str]:
    """(prompt ids, text, finish reason) of greedy generation in this process."""
    engine, tokenizer = reference
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    out = engine.generate(ids, max_tokens)
    eos = set(tokenizer.eos_token_ids)
    finish = "stop" if out[-1] in eos else "length"
    return ids, tokenizer.decode([t for t in out if t not in eos]), finish


def ask(stack, messages: list[dict], max_tokens: int):
    return client(stack).chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )


def test_greedy_replies_equal_single_process_generation(stack, reference):
    for question in QUESTIONS[:3]:
        messages = [{"role": "user", "content": question}]
        reply = ask(stack, messages, 24)
        ids, text, finish = reference_reply(reference, messages, 24)
        assert reply.choices[0].message.content == text
        assert reply.choices[0].finish_reason == finish
        assert reply.usage.prompt_tokens == len(ids)


def test_eight_concurrent_requests_equal_single_process_generation(stack, reference):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    with ThreadPoolExecutor(len(conversations)) as pool:
        replies = list(pool.map(lambda m: ask(stack, m, 16), conversations))
    for messages, reply in zip(conversations, replies):
        _, text, finish = reference_reply(reference, messages, 16)
        assert reply.choices[0].message.content == text, messages[0]["content"]
        assert reply.choices[0].finish_reason == finish


def test_openai_client_streams_the_same_reply_with_usage(stack, reference):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTIONS[3]}]
    stream = client(stack).chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    ids, text, expected_finish = reference_reply(reference, messages, 20)
    assert "".join(pieces) == text
    assert finish == expected_finish
    assert usage.prompt_tokens == len(ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert len([p for p in pieces if p]) > 3, "text should arrive in several chunks"


def _shared_prefix_blocks(a: list[int], b: list[int], block: int = 64) -> int:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    return min(common, len(b) - 1) // block * block


def test_shared_prefix_is_reused_and_output_matches_cold_run(stack, reference):
    first = [{"role": "system", "content": LONG_CONTEXT}, {"role": "user", "content": "Do gift cards expire?"}]
    second = [{"role": "system", "content": LONG_CONTEXT}, {"role": "user", "content": "When do you open on Sunday?"}]
    ask(stack, first, 4)
    reply = ask(stack, second, 24)
    first_ids, _, _ = reference_reply(reference, first, 1)
    second_ids, cold_text, _ = reference_reply(reference, second, 24)
    expected_cached = _shared_prefix_blocks(first_ids, second_ids)
    assert expected_cached >= 256
    assert reply.usage.prompt_tokens_details.cached_tokens == expected_cached
    assert reply.choices[0].message.content == cold_text


def test_prefix_evicted_from_prefill_is_served_from_kvstore(stack, reference):
    context = LONG_CONTEXT.replace("Crescent Hardware", "Lunar Books") * 2  # ~750 tokens
    flood = " ".join(f"item{i}" for i in range(400))  # ~1,500 tokens: pushes the context out of prefill
    before = stack.metric("prefill-0", "crescent_engine_cached_tokens_total", {"source": "kvstore"})
    ask(stack, [{"role": "system", "content": context}, {"role": "user", "content": "Hi"}], 1)
    ask(stack, [{"role": "user", "content": flood}], 1)
    messages = [{"role": "system", "content": context}, {"role": "user", "content": "Do you sell maps?"}]
    reply = ask(stack, messages, 16)
    ids, cold_text, _ = reference_reply(reference, messages, 16)
    from_kvstore = stack.metric("prefill-0", "crescent_engine_cached_tokens_total", {"source": "kvstore"}) - before
    assert from_kvstore >= 640, "the evicted prefix should come back from the kvstore"
    assert reply.usage.prompt_tokens_details.cached_tokens >= 640
    assert reply.choices[0].message.content == cold_text


def test_client_disconnect_frees_decode_slot_and_kv(stack):
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": LONG_REPLY}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{stack.url}/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            received = 0
            for line in lines:
                received += line.startswith("data:")
                if received >= 4:
                    break
            assert stack.metric("decode-0", "crescent_engine_running_requests") == 1
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if stack.metric("decode-0", "crescent_engine_running_requests") == 0 and \
                stack.metric("decode-0", "crescent_engine_kv_used_tokens") == 0:
            break
        time.sleep(0.05)
    assert stack.metric("decode-0", "crescent_engine_running_requests") == 0
    assert stack.metric("decode-0", "crescent_engine_kv_used_tokens") == 0
    assert ask(stack, [{"role": "user", "content": "Hi"}], 2).choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ({"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": DEFAULT_MODEL, "messages": []}, 400, "messages"),
        ({"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages"),
    ],
)
def test_bad_input_gets_an_openai_error_and_the_stack_keeps_serving(stack, body, status, param):
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert ask(stack, [{"role": "user", "content": "Hi"}], 2).choices[0].message.content


def test_malformed_json_is_a_400(stack):
    response = httpx.post(f"{stack.url}/v1/chat/completions", content=b"{not json", timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


EXPECTED_METRICS = {
    "gateway": ["crescent_gateway_ttft_seconds_bucket", "crescent_gateway_inter_token_seconds_bucket",
                "crescent_gateway_e2e_seconds_bucket", "crescent_gateway_prompt_tokens_total",
                "crescent_gateway_cached_tokens_total"],
    "scheduler": ["crescent_scheduler_placements_total", "crescent_scheduler_instances"],
    "prefill": ["crescent_engine_queue_depth", "crescent_engine_prompt_tokens_total",
                "crescent_engine_cached_tokens_total", "crescent_engine_computed_tokens_total"],
    "decode": ["crescent_engine_running_requests", "crescent_engine_batch_size_bucket",
               "crescent_engine_kv_used_tokens", "crescent_engine_generated_tokens_total"],
    "kvstore": ["crescent_kvstore_blocks", "crescent_kvstore_bytes", "crescent_kvstore_evictions_total"],
}


def test_every_service_exposes_its_metrics_and_health(stack):
    ask(stack, [{"role": "user", "content": "Hello"}], 2)
    for service in stack.services:
        assert httpx.get(service["health_url"], timeout=5).status_code == 200
        text = httpx.get(service["metrics_url"], timeout=5).text
        for name in EXPECTED_METRICS[service["role"]]:
            assert name in text, f"{service['name']} lacks {name}"
