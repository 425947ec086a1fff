"""The gateway through the real ``openai`` client, as a user would call it."""

from __future__ import annotations

import time

import openai
import pytest
from crescent.services.contract.block_keys import prefix_block_keys

from .fake_tokenizer import MODEL_ID, FakeTokenizer
from .support import BLOCK_SIZE, FakeBackend, served_salt

TOKENIZER = FakeTokenizer()


def prompt_ids(*user_messages: str) -> list[int]:
    messages = [{"role": "user", "content": m} for m in user_messages]
    return TOKENIZER.encode(TOKENIZER.apply_chat_template(messages))


def decode_events(
    backend: FakeBackend, request_id: str, wait_for: str | None = None, timeout_s: float = 1.0
) -> list[str]:
    """The events fake decode saw for a request; waits (up to timeout_s) for ``wait_for`` if given."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = [e["event"] for e in backend.get("/decode-events") if e["request_id"] == request_id]
        if wait_for is None or wait_for in events or time.monotonic() > deadline:
            return events
        time.sleep(0.02)


def test_non_streaming_completion(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello world"}])
    assert reply.id.startswith("chatcmpl-")
    assert reply.model == model
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == "hello world"
    assert reply.choices[0].finish_reason == "stop"
    # "hello world" is 6 pair tokens, then end-of-turn: the end token counts, its text does not show.
    assert reply.usage.prompt_tokens == len(prompt_ids("hello world"))
    assert reply.usage.completion_tokens == 7
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 7


def test_streaming_completion(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "#batch=3 streaming works"}],
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "streaming works"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    assert usage_chunks[0].usage.completion_tokens == 9  # 8 pair tokens + end-of-turn
    assert usage_chunks[0].usage.prompt_tokens == len(prompt_ids("#batch=3 streaming works"))


def test_max_tokens_ends_with_length(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "#loop abcd"}], max_tokens=5
    )
    assert reply.choices[0].message.content == "abcdabcdab"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5

    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "#loop abcd"}], max_completion_tokens=3, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "abcdab"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_tokens_one_finishes_in_prefill(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "xyz"}], max_tokens=1)
    assert reply.choices[0].message.content == "xy"
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_tokens(client: openai.OpenAI, model: str, backend: FakeBackend, stream: bool) -> None:
    # Tokens: "he" "ll" "o " "wo" "rl" "d " ...; "lo w" starts inside "ll" and ends inside "wo".
    messages = [{"role": "user", "content": "#loop #delay=0.02 hello world "}]
    if stream:
        chunks = list(client.chat.completions.create(model=model, messages=messages, stop="lo w", stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish, request_id = chunks[-1].choices[0].finish_reason, chunks[0].id
    else:
        reply = client.chat.completions.create(model=model, messages=messages, stop=["zzz", "lo w"])
        text, finish, request_id = reply.choices[0].message.content, reply.choices[0].finish_reason, reply.id
        assert reply.usage.completion_tokens == 4  # up to the token that completed the stop string
    assert text == "hel"
    assert finish == "stop"
    # The reply would never end by itself: the gateway must have cancelled decode's stream.
    assert "cancelled" in decode_events(backend, request_id, wait_for="cancelled")


def test_stop_string_in_first_token_aborts_decode(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "#loop abc"}], stop="b"
    )
    assert reply.choices[0].message.content == "a"
    assert reply.choices[0].finish_reason == "stop"
    # The gateway never needed decode's stream: one Abort frees the request in decode, whether
    # the handoff had landed (aborted) or not (a tombstone refuses it later).
    deadline = time.monotonic() + 1.0
    while not {"aborted", "tombstone"} & set(decode_events(backend, reply.id)):
        assert time.monotonic() < deadline, decode_events(backend, reply.id)
        time.sleep(0.02)
    assert "opened" not in decode_events(backend, reply.id)
    assert reply.id not in backend.get("/jobs")


def test_stop_string_never_matching_is_flushed(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "the end is nea"}], stop="near"
    )
    assert reply.choices[0].message.content == "the end is nea"
    assert reply.choices[0].finish_reason == "stop"


def test_cached_tokens_and_cache_salt(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    message = "a long shared prefix that several requests reuse " * 2
    messages = [{"role": "user", "content": message}]
    ids = prompt_ids(message)
    full_blocks = len(ids) // BLOCK_SIZE * BLOCK_SIZE

    cold = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    warm = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    salted = client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                            extra_body={"cache_salt": "tenant-a"})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == full_blocks > 0
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # another tenant's cache is not shared
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens == len(ids)

    # The scheduler got the salted keys of the prompt's full blocks, as prefill computes them.
    place = next(p for p in backend.get("/places") if p["request_id"] == salted.id)
    # The salt is the tenant's (derived on the server) narrowed by the client's, never the client's text.
    expected = prefix_block_keys(ids, BLOCK_SIZE, MODEL_ID, served_salt("tenant-a"))
    assert place["block_keys"] == [k.hex() for k in expected]
    assert place["prompt_tokens"] == len(ids) and place["max_tokens"] == 2


def test_sampling_parameters_reach_prefill(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        temperature=0.5, top_p=0.9, seed=1234, max_tokens=7, user="u-1", extra_body={"top_k": 40},
    )
    sent = next(p for p in backend.get("/prefills") if p["request_id"] == reply.id)
    assert sent["temperature"] == pytest.approx(0.5)
    assert sent["top_p"] == pytest.approx(0.9)
    assert (sent["top_k"], sent["seed"], sent["max_tokens"]) == (40, 1234, 7)
    assert sorted(sent["stop_token_ids"]) == sorted(TOKENIZER.eos_token_ids)
    assert sent["model_id"] == MODEL_ID


def test_default_max_tokens_fill_the_context(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    sent = next(p for p in backend.get("/prefills") if p["request_id"] == reply.id)
    # The test gateway's window is 256 tokens, below default_max_tokens: the rest of the window is the cap.
    assert sent["max_tokens"] == 256 - len(prompt_ids("hi"))


def test_models_endpoint(client: openai.OpenAI, model: str) -> None:
    assert [m.id for m in client.models.list()] == [model]
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
