"""Request migration: a failed placement is placed again and the client sees one stream.

Fake prefill and decode (``fake_backend``) fail on cue; the gateway is the real process. A
migrated request must give exactly the text an uninterrupted run gives (the fake is
deterministic, like temperature 0), with every continuation placed as prompt + the tokens the
client already has.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from crescent.services.contract.block_keys import prefix_block_keys

from .fake_tokenizer import MODEL_ID, FakeTokenizer
from .in_process import InProcessGateway
from .support import BLOCK_SIZE, FakeBackend, Gateway, served_salt
from .test_health_metrics import metric

TOKENIZER = FakeTokenizer()


def words() -> str:
    """A reply text no other test uses (the fake counts failures per prompt)."""
    return "w" + uuid.uuid4().hex[:11]


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def migrations(gateway: Gateway, stage: str) -> float:
    text = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    return metric(text, "crescent_gateway_migrations_total", f'{{stage="{stage}"}}')


def attempts(backend: FakeBackend, request_id: str) -> list[dict[str, Any]]:
    """The prefills of one request, in order: the original, then each migration."""
    return [p for p in backend.get("/prefills") if p["request_id"].split("-m")[0] == request_id]


def streamed(client: openai.OpenAI, content: str, **options: Any) -> tuple[str, str, str, int]:
    """(request id, text, finish reason, completion tokens) of a streamed completion."""
    stream = client.chat.completions.create(model=MODEL_ID, messages=user(content), stream=True,
                                            stream_options={"include_usage": True}, **options)
    text, finish, usage, rid = [], None, None, ""
    for chunk in stream:
        rid = chunk.id
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    assert finish is not None and usage is not None
    return rid, "".join(text), finish, usage


def test_decode_failures_mid_stream_lose_and_repeat_no_token(
    gateway: Gateway, backend: FakeBackend, client: openai.OpenAI
) -> None:
    text = words()
    uninterrupted = client.chat.completions.create(model=MODEL_ID, messages=user(f"#loop {text}"), max_tokens=30)
    before = migrations(gateway, "mid_stream")
    # Every decode stream breaks after two events: the request moves ten times.
    rid, got, finish, completion_tokens = streamed(client, f"#loop #fail_after=2 {text}", max_tokens=30)
    assert got == uninterrupted.choices[0].message.content
    assert (finish, completion_tokens) == ("length", 30)

    tried = attempts(backend, rid)
    assert len(tried) == 10 and migrations(gateway, "mid_stream") - before == 9
    prompt = tried[0]["token_ids"]
    reply = TOKENIZER.encode(text)
    places = {p["request_id"]: p for p in backend.get("/places")}
    for n, attempt in enumerate(tried):
        step = attempt["first_step"]
        assert attempt["request_id"] == (rid if n == 0 else f"{rid}-m{n}")  # a fresh id per placement
        assert step == 3 * n  # first token + two events per attempt
        # The continuation's prompt is the prompt plus exactly the tokens the client has.
        assert attempt["token_ids"] == prompt + [reply[i % len(reply)] for i in range(step)]
        assert attempt["max_tokens"] == 30 - step
        place = places[attempt["request_id"]]
        assert place["block_keys"] == [k.hex() for k in prefix_block_keys(attempt["token_ids"], BLOCK_SIZE, MODEL_ID, served_salt())]
        assert place["block_size"] == BLOCK_SIZE


def test_prefill_failures_before_the_first_token_are_invisible(
    gateway: Gateway, backend: FakeBackend, client: openai.OpenAI
) -> None:
    text = words()
    before = migrations(gateway, "before_first_token")
    rid, got, finish, _ = streamed(client, f"#prefill_fail=2 {text}")
    assert (got, finish) == (text, "stop")
    tried = attempts(backend, rid)
    assert [(p["request_id"], p["first_step"], p["outcome"]) for p in tried] == [
        (rid, 0, "failed"), (f"{rid}-m1", 0, "failed"), (f"{rid}-m2", 0, "done")]
    assert migrations(gateway, "before_first_token") - before == 2
    # The failed placements never reached decode: released in the scheduler, aborted in decode.
    outcomes = backend.get("/outcomes")
    for failed in (rid, f"{rid}-m1"):
        assert any(o["request_id"] == failed and o["released"] for o in outcomes)
        assert any(a["request_id"] == failed for a in backend.get("/aborts"))


def test_prefill_failure_after_the_first_token_continues_from_it(
    gateway: Gateway, backend: FakeBackend, client: openai.OpenAI
) -> None:
    text = words()
    rid, got, finish, completion_tokens = streamed(client, f"#handoff_fail=1 {text}")
    assert (got, finish) == (text, "stop")
    assert completion_tokens == len(TOKENIZER.encode(text)) + 1  # + end of turn
    first, second = attempts(backend, rid)
    assert second["first_step"] == 1 and second["token_ids"] == first["token_ids"] + TOKENIZER.encode(text)[:1]


@pytest.fixture(scope="module")
def impatient_gateway(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway that gives up after two placements in a row failed."""
    gw = InProcessGateway(tmp_path_factory.mktemp("impatient"), backend.address, migration_retries=2)
    gw.start_gateway()
    yield gw
    assert gw.stop() == 0


def sse_events(url: str, content: str) -> list[Any]:
    body = {"model": MODEL_ID, "messages": user(content), "stream": True}
    events: list[Any] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=20) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_a_stream_that_cannot_move_ends_with_an_error_event(impatient_gateway: Gateway) -> None:
    text = words()
    # Two tokens arrive, decode dies, and every placement after that fails.
    events = sse_events(impatient_gateway.url, f"#loop #fail_after=1 #stuck_after=2 {text}")
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["choices"][0]["finish_reason"] == "error"
    assert last["error"]["code"] == "backend_unavailable" and "3 placements" in last["error"]["message"]
    delivered = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2])
    assert delivered == "".join(TOKENIZER.decode([t]) for t in TOKENIZER.encode(text)[:2])


def test_a_request_no_placement_can_serve_is_a_503(impatient_gateway: Gateway, backend: FakeBackend) -> None:
    body = {"model": MODEL_ID, "messages": user(f"#prefill_fail=100 {words()}")}
    reply = httpx.post(f"{impatient_gateway.url}/v1/chat/completions", json=body, timeout=20)
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["code"] == "backend_unavailable"
