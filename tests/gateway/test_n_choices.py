"""``n > 1`` on ``/v1/chat/completions`` and ``/v1/completions``, through the real ``openai`` client.

A prompt's choices are one backend request (one placement with ``n``, one prefill that samples
every choice's first token, one decode stream; ``test_choice_group`` covers its failures). The
fake backend stands for sampling with ``#draw``: choice i of a request seeded with s gets the first
``1 + choice_seed(s, i) % W`` of the message's W words, so choices differ as sampled ones would.
The fake tokenizer makes a token of every two ASCII characters.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from crescent.services.gateway.choices import MAX_CHOICES, choice_seed
from crescent.services.gateway.model_policy import K3_POLICY

from .fake_tokenizer import MODEL_ID, FakeTokenizer
from .in_process import InProcessGateway
from .support import BLOCK_SIZE, FakeBackend, Gateway

TOKENIZER = FakeTokenizer()
WORDS = ["alpha", "beta", "gamma", "delta"]
DRAW = "#draw " + " ".join(WORDS)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def drawn_words(seed: int, i: int) -> int:
    """How many words choice i of a request seeded with ``seed`` says (``#draw``)."""
    return 1 + choice_seed(seed, i) % len(WORDS)  # type: ignore[operator]


def a_seed(want: Any) -> int:
    """The first seed whose three choices' word counts satisfy ``want``."""
    return next(s for s in range(10_000) if want([drawn_words(s, i) for i in range(3)]))


def expected(words: int, max_tokens: int) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of a choice saying ``words`` words (its end-of-turn token counts)."""
    tokens = TOKENIZER.encode(" ".join(WORDS[:words]))
    if len(tokens) + 1 <= max_tokens:
        return " ".join(WORDS[:words]), "stop", len(tokens) + 1
    return TOKENIZER.decode(tokens[:max_tokens]), "length", max_tokens


def prefill_of(backend: FakeBackend, request_id: str) -> dict[str, Any]:
    """What prefill received for a request, all its choices together; it had no other prefill."""
    [found] = [p for p in backend.get("/prefills") if p["request_id"].startswith(request_id)]
    assert found["request_id"] == request_id
    return found


def wait_until_freed(backend: FakeBackend, request_id: str, timeout_s: float = 2.0) -> None:
    """Decode let the request go: an Abort of all of it came, and its stream was cancelled (or it was
    dropped before one opened)."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = [e["event"] for e in backend.get("/decode-events") if e["request_id"] == request_id]
        aborted = any(a["request_id"] == request_id and not a["one_choice"] for a in backend.get("/aborts"))
        if {"cancelled", "aborted"} & set(events) and aborted:
            assert request_id not in backend.get("/jobs")
            return
        assert time.monotonic() < deadline, f"decode did not free {request_id}: {events}, aborted: {aborted}"
        time.sleep(0.02)


def test_chat_choices_are_separate_draws_with_their_own_finish(client: openai.OpenAI, model: str,
                                                               backend: FakeBackend) -> None:
    seed = a_seed(lambda counts: 1 in counts and max(counts) >= 3 and len(set(counts)) == 3)
    reply = client.chat.completions.create(model=model, messages=user(DRAW), n=3, seed=seed, max_tokens=6,
                                           extra_body={"cache_salt": uuid.uuid4().hex})
    want = [expected(drawn_words(seed, i), 6) for i in range(3)]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [(c.message.content, c.finish_reason) for c in reply.choices] == [(t, f) for t, f, _ in want]
    assert {f for _, f, _ in want} == {"stop", "length"}, "the seed was picked so that finishes differ"
    prompt_tokens = prefill_of(backend, reply.id)["prompt_tokens"]
    assert reply.usage.prompt_tokens == prompt_tokens, "the prompt counts once"
    assert reply.usage.completion_tokens == sum(c for _, _, c in want)
    assert reply.usage.total_tokens == prompt_tokens + sum(c for _, _, c in want)


def test_choice_seeds_are_derived_and_choice_0_equals_n_1(client: openai.OpenAI, model: str,
                                                          backend: FakeBackend) -> None:
    seed = a_seed(lambda counts: len(set(counts)) == 3)
    reply = client.chat.completions.create(model=model, messages=user(DRAW), n=3, seed=seed)
    sent = prefill_of(backend, reply.id)  # prefill derives choice i's seed (choice_seed) itself
    assert (sent["seed"], sent["n"]) == (seed, 3)
    again = client.chat.completions.create(model=model, messages=user(DRAW), n=3, seed=seed)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    single = client.chat.completions.create(model=model, messages=user(DRAW), seed=seed)
    assert single.choices[0].message.content == reply.choices[0].message.content

    unseeded = client.chat.completions.create(model=model, messages=user(DRAW), n=2)
    assert (prefill_of(backend, unseeded.id)["seed"], prefill_of(backend, unseeded.id)["n"]) == (None, 2)


def test_the_prompt_is_placed_prefilled_and_decoded_once(client: openai.OpenAI, model: str,
                                                         backend: FakeBackend) -> None:
    reply = client.chat.completions.create(model=model, messages=user("share me " * 3), n=3,
                                           extra_body={"cache_salt": uuid.uuid4().hex})
    places = [p for p in backend.get("/places") if p["request_id"].startswith(reply.id)]
    assert [(p["request_id"], p["n"]) for p in places] == [(reply.id, 3)]
    assert prefill_of(backend, reply.id)["cached_tokens"] == reply.usage.prompt_tokens_details.cached_tokens == 0
    opened = [e["request_id"] for e in backend.get("/decode-events") if e["event"] == "opened"]
    assert [rid for rid in opened if rid.startswith(reply.id)] == [reply.id]
    assert reply.usage.prompt_tokens == prefill_of(backend, reply.id)["prompt_tokens"] > BLOCK_SIZE
    assert len({c.message.content for c in reply.choices}) == 1  # the fake's echo: no sampling without #draw


def test_chat_stream_interleaves_choices(client: openai.OpenAI, model: str) -> None:
    seed = a_seed(lambda counts: counts[0] == 4 and counts[1] != counts[2])
    stream = client.chat.completions.create(model=model, messages=user("#delay=0.02 " + DRAW), n=3, seed=seed,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    *deltas, last = chunks
    assert last.choices == [] and last.usage is not None and all(c.usage is None for c in deltas)
    texts: dict[int, str] = {}
    roles: dict[int, int] = {}
    finishes: dict[int, list[str]] = {}
    order = []
    for chunk in deltas:
        [choice] = chunk.choices
        order.append(choice.index)
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        roles[choice.index] = roles.get(choice.index, 0) + (choice.delta.role == "assistant")
        if choice.finish_reason:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    want = [expected(drawn_words(seed, i), 10_000) for i in range(3)]
    assert texts == {i: t for i, (t, _, _) in enumerate(want)}
    assert roles == {0: 1, 1: 1, 2: 1} and finishes == {0: ["stop"], 1: ["stop"], 2: ["stop"]}
    assert order.index(1) < len(order) - 1 - order[::-1].index(0), "choice 1 streamed only after choice 0 ended"
    assert last.usage.completion_tokens == sum(c for _, _, c in want)


def test_stop_strings_apply_to_each_choice(client: openai.OpenAI, model: str) -> None:
    seed = a_seed(lambda counts: counts[0] >= 3 and min(counts) < 3)
    reply = client.chat.completions.create(model=model, messages=user(DRAW), n=3, seed=seed, stop=["gam"])
    for choice, i in zip(reply.choices, range(3)):
        words = drawn_words(seed, i)
        assert choice.finish_reason == "stop"
        assert choice.message.content == ("alpha beta " if words >= 3 else " ".join(WORDS[:words]))


def test_logprobs_per_choice(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(model=model, messages=user("hello there"), n=2, logprobs=True,
                                           top_logprobs=2)
    for choice in reply.choices:
        entries = choice.logprobs.content
        assert "".join(e.token for e in entries) == choice.message.content == "hello there"
        assert [e.logprob for e in entries] == [-(k + 1) / 8 for k in range(len(entries))]
        assert all(len(e.top_logprobs) == 2 for e in entries)
    text = client.completions.create(model=model, prompt="hello there", n=2, logprobs=1)
    for choice in text.choices:
        assert "".join(choice.logprobs.tokens) == choice.text == "hello there"


def test_completions_number_choices_per_prompt(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    seed = a_seed(lambda counts: len(set(counts)) == 3)
    reply = client.completions.create(model=model, prompt=[DRAW, "plain text"], n=3, seed=seed, max_tokens=50)
    assert [c.index for c in reply.choices] == list(range(6))
    drawn = [expected(drawn_words(seed, i), 50)[0] for i in range(3)]
    assert [c.text for c in reply.choices] == drawn + ["plain text"] * 3
    prompts = [len(TOKENIZER.encode(p)) for p in (DRAW, "plain text")]
    completions = sum(expected(drawn_words(seed, i), 50)[2] for i in range(3)) + 3 * (len(TOKENIZER.encode("plain text")) + 1)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (sum(prompts), completions)
    for p in (0, 1):
        sent = prefill_of(backend, f"{reply.id}-{p}")
        assert (sent["seed"], sent["n"]) == (seed, 3)

    stream = client.completions.create(model=model, prompt=["#batch=2 one", "#batch=2 two"], n=2, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {0: "one", 1: "one", 2: "two", 3: "two"} and finishes == dict.fromkeys(range(4), "stop")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4 * 3


def test_best_of_equal_to_n_is_accepted(client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt="same", n=2, best_of=2)
    assert [c.text for c in reply.choices] == ["same", "same"]


def test_a_client_that_goes_away_aborts_every_choice(gateway: Gateway, backend: FakeBackend) -> None:
    body = {"model": MODEL_ID, "messages": user("#loop #delay=0.05 again "), "n": 3, "stream": True}
    seen: set[int] = set()
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=10) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                chunk = json.loads(line[len("data: "):])
                request_id = chunk["id"]
                seen |= {c["index"] for c in chunk["choices"] if c["delta"].get("content")}
            if seen == {0, 1, 2}:
                break
    wait_until_freed(backend, request_id)  # the choices' one request


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_above_the_limit_is_refused_by_name(gateway: Gateway, path: str) -> None:
    body: dict[str, Any] = {"model": MODEL_ID, "n": MAX_CHOICES + 1}
    body.update({"messages": user("hi")} if "chat" in path else {"prompt": "hi"})
    error = httpx.post(f"{gateway.url}{path}", json=body, timeout=10).json()["error"]
    assert error["param"] == "n" and str(MAX_CHOICES) in error["message"]


def test_too_many_choices_over_prompts_are_refused(gateway: Gateway) -> None:
    body = {"model": MODEL_ID, "prompt": ["hi"] * 9, "n": MAX_CHOICES}
    reply = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"
    assert "144 choices" in reply.json()["error"]["message"]


@pytest.fixture(scope="module")
def kimi_card(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway whose model card is Kimi K3's, which fixes n at 1."""
    gw = InProcessGateway(tmp_path_factory.mktemp("kimi-card-n"), backend.address,
                          model_policy=K3_POLICY.model_dump())
    gw.start_gateway()
    yield gw
    assert gw.stop() == 0


def test_a_card_that_locks_n_refuses_it_by_name(kimi_card: Gateway) -> None:
    body = {"model": MODEL_ID, "messages": user("hi"), "n": 2}
    reply = httpx.post(f"{kimi_card.url}/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == 400
    assert (reply.json()["error"]["param"], reply.json()["error"]["code"]) == ("n", "locked_parameter")
    assert httpx.post(f"{kimi_card.url}/v1/chat/completions", json={**body, "n": 1}, timeout=10).status_code == 200


@pytest.fixture(scope="module")
def no_retries(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway that does not place a failed request again."""
    gw = InProcessGateway(tmp_path_factory.mktemp("no-retries"), backend.address, migration_retries=0)
    gw.start_gateway()
    yield gw
    assert gw.stop() == 0


def test_a_choice_that_fails_mid_stream_ends_every_choice_with_an_error(no_retries: Gateway) -> None:
    # The choices' decode dies after 3 events, and this gateway places no choice again.
    body = {"model": MODEL_ID, "messages": user("#loop #delay=0.05 #fail_after=3 abcd"), "n": 3, "stream": True}
    with httpx.stream("POST", f"{no_retries.url}/v1/chat/completions", json=body, timeout=20) as reply:
        assert reply.status_code == 200
        lines = [line[len("data: "):] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    last = json.loads(lines[-2])
    assert {(c["index"], c["finish_reason"]) for c in last["choices"]} == {(0, "error"), (1, "error"), (2, "error")}
    assert last["error"]["code"] == "backend_unavailable"
    roles = [c["index"] for line in lines[:-2] for c in json.loads(line)["choices"] if c["delta"].get("role")]
    assert sorted(roles) == [0, 1, 2]

    with pytest.raises(openai.APIError):  # the SDK raises the error event
        with openai.OpenAI(base_url=f"{no_retries.url}/v1", api_key="unused", max_retries=0) as client:
            list(client.chat.completions.create(model=MODEL_ID, messages=body["messages"], n=3, stream=True))
