"""``n > 1`` as one placement (``choice_group``): routing, per-choice aborts, per-choice migration.

The fake backend (a real process on loopback) plays the engines' side of the contract: prefill
sends a first token per choice, decode streams the choices' events tagged by index and ends one
choice alone on ``Abort(one_choice)``. ``#draw`` stands for sampling (choice i says the first
``1 + choice_seed(seed, i) % 4`` words), ``#loop`` repeats them until ``max_tokens``. Some tests
drive ``GrpcBackend`` in this process, to see each choice's backend events.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import openai
from crescent.services.gateway.backend import BackendEvent, FirstToken, GenerationRequest, RequestId, Sampling
from crescent.services.gateway.choices import choice_seed, fan_out
from crescent.services.gateway.attempts.grpc_backend import GrpcBackend

from .fake_tokenizer import IM_END, MODEL_ID, FakeTokenizer
from .support import FakeBackend, Gateway

TOKENIZER = FakeTokenizer()
WORDS = ["alpha", "beta", "gamma", "delta"]


def words_of(seed: int, i: int) -> int:
    return 1 + choice_seed(seed, i) % len(WORDS)  # type: ignore[operator]


def a_seed(want: Any, n: int = 3) -> int:
    return next(s for s in range(10_000) if want([words_of(s, i) for i in range(n)]))


def reply_tokens(seed: int, i: int, *, loop_to: int | None = None) -> list[int]:
    """What choice i says: its words and end-of-turn, or (``#loop``) its words repeated to ``loop_to`` tokens."""
    said = TOKENIZER.encode(" ".join(WORDS[:words_of(seed, i)]))
    return said + [IM_END] if loop_to is None else [said[k % len(said)] for k in range(loop_to)]


def poll(what: Any, timeout_s: float = 3.0) -> Any:
    """``what()`` once it is truthy."""
    deadline = time.monotonic() + timeout_s
    while not (found := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return found


def of(backend: FakeBackend, path: str, request_id: str) -> list[dict[str, Any]]:
    return [r for r in backend.get(path) if r["request_id"].startswith(request_id)]


def generation(text: str, seed: int, max_tokens: int) -> GenerationRequest:
    """A raw-text prompt (the fake echoes it, directives removed)."""
    sampling = Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=seed, max_tokens=max_tokens,
                        stop_token_ids=(IM_END,))
    return GenerationRequest(RequestId(f"group-{uuid.uuid4().hex[:8]}"), MODEL_ID, tuple(TOKENIZER.encode(text)),
                             b"", sampling)


def grpc_backend(backend: FakeBackend) -> GrpcBackend:
    return GrpcBackend(backend.address, request_timeout_s=10, place_timeout_s=2, health_timeout_s=2)


def test_each_choice_gets_its_own_events_in_order(backend: FakeBackend) -> None:
    seed = a_seed(lambda counts: len(set(counts)) == 3)
    request = generation("#delay=0.01 #draw " + " ".join(WORDS), seed, max_tokens=50)
    arrivals: list[tuple[int, BackendEvent]] = []

    async def read(i: int, events: Any) -> None:
        async for event in events:
            arrivals.append((i, event))

    async def main() -> None:
        grpc = grpc_backend(backend)
        try:
            choices = grpc.generate_choices(request, 3)
            await asyncio.gather(*(read(i, e) for i, e in enumerate(choices)))
        finally:
            await grpc.close()

    asyncio.run(main())
    for i in range(3):
        first, *more = [e for j, e in arrivals if j == i]
        assert isinstance(first, FirstToken) and first.prompt_tokens == len(request.prompt_token_ids)
        assert [first.token_id] + [t for e in more for t in e.token_ids] == reply_tokens(seed, i)
        assert more[-1].finish_reason == "stop" and all(e.finish_reason is None for e in more[:-1])
    order = [i for i, _ in arrivals]
    assert order[:3] == [0, 1, 2], "the first tokens come first, in choice order"
    assert order.index(2, 3) < len(order) - 1 - order[::-1].index(0), "decode's events were not interleaved"
    [place] = of(backend, "/places", request.request_id)
    assert (place["request_id"], place["n"]) == (request.request_id, 3)


def test_choices_closed_unread_let_the_placement_go(backend: FakeBackend) -> None:
    request = generation("#loop #delay=0.05 never read", 1, max_tokens=1000)

    def whole_aborts() -> list[dict[str, Any]]:
        return [a for a in of(backend, "/aborts", request.request_id) if not a["one_choice"]]

    async def main() -> None:
        grpc = grpc_backend(backend)
        try:
            first, second = grpc.generate_choices(request, 2)
            assert isinstance(await anext(first), FirstToken)
            await first.aclose()  # the other is still open: decode ends choice 0 alone, once it holds it
            await second.aclose()  # never read, and the last: the placement is let go
            # Watched while this loop runs (closing the loop would cancel a leaked attempt too).
            aborts = await asyncio.to_thread(poll, whole_aborts)
            assert [a["request_id"] for a in aborts] == [request.request_id]
        finally:
            await grpc.close()

    asyncio.run(main())
    assert request.request_id not in backend.get("/jobs")


def test_a_choice_that_stops_early_is_aborted_alone(client: openai.OpenAI, backend: FakeBackend) -> None:
    seed = a_seed(lambda counts: counts[1] >= 3 and counts[0] < 3 and counts[2] < 3)
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "#loop #delay=0.02 #draw " + " ".join(WORDS)}],
        n=3, seed=seed, max_tokens=20, stop=["gam"])
    assert [(c.message.content, c.finish_reason) for c in reply.choices] == [
        (TOKENIZER.decode(reply_tokens(seed, 0, loop_to=20)), "length"),
        ("alpha beta ", "stop"),
        (TOKENIZER.decode(reply_tokens(seed, 2, loop_to=20)), "length"),
    ]
    poll(lambda: of(backend, "/aborts", reply.id))
    time.sleep(0.2)  # an Abort of the whole request would be on its way by now
    aborts = of(backend, "/aborts", reply.id)
    assert [(a["request_id"], a["one_choice"], a["index"]) for a in aborts] == [(reply.id, True, 1)]
    assert "aborted choice 1" in [e["event"] for e in of(backend, "/decode-events", reply.id)]


def test_a_failed_group_migrates_each_choice_alone(client: openai.OpenAI, backend: FakeBackend) -> None:
    seed = a_seed(lambda counts: len(set(counts)) == 3)
    # Every decode stream breaks after two events: the group, then each choice's own placements.
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "#loop #fail_after=2 #draw " + " ".join(WORDS)}],
        n=3, seed=seed, max_tokens=12, stream=True, stream_options={"include_usage": True})
    texts = {i: "" for i in range(3)}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        rid = chunk.id
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes.get(c.index, "")
        usage = chunk.usage or usage
    assert texts == {i: TOKENIZER.decode(reply_tokens(seed, i, loop_to=12)) for i in range(3)}
    assert finishes == dict.fromkeys(range(3), "length") and usage is not None and usage.completion_tokens == 36

    prefills = {p["request_id"]: p for p in of(backend, "/prefills", rid)}
    places = {p["request_id"]: p for p in of(backend, "/places", rid)}
    prompt = prefills[rid]["token_ids"]
    assert (prefills[rid]["n"], places[rid]["n"]) == (3, 3)
    assert len(prefills) == 1 + 3 * 3  # the group, then three placements per choice
    for i in range(3):
        said = reply_tokens(seed, i, loop_to=12)
        for k in (1, 2, 3):
            alone = prefills[f"{rid}-c{i}-m{k}"]  # a choice migrates as the n = 1 request <id>-c<i>
            assert alone["first_step"] == 3 * k and alone["token_ids"] == prompt + said[:3 * k]
            assert (alone["seed"], alone["n"], alone["max_tokens"]) == (choice_seed(seed, i), 0, 12 - 3 * k)
            assert places[f"{rid}-c{i}-m{k}"]["n"] == 0


def test_choices_finished_at_their_first_tokens_open_no_decode_stream(
        client: openai.OpenAI, backend: FakeBackend) -> None:
    reply = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hello"}],
                                           n=3, max_tokens=1)
    assert [(c.message.content, c.finish_reason) for c in reply.choices] == [("he", "length")] * 3
    assert reply.usage.completion_tokens == 3
    poll(lambda: of(backend, "/prefills", reply.id)[0]["outcome"] == "done")  # read to its end, not cancelled
    assert of(backend, "/decode-events", reply.id) == [] and of(backend, "/aborts", reply.id) == []
    assert [o["released"] for o in of(backend, "/outcomes", reply.id)] == [True]


def test_a_refused_group_is_every_choice_s_answer(gateway: Gateway, backend: FakeBackend) -> None:
    backend.post("/reject", {"reason": "ttft_slo", "message": "predicted TTFT 40 s > 30 s", "retry_after_s": 3})
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "refused"}], "n": 3}
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == 429 and reply.headers["retry-after"] == "3"
    assert "ttft_slo" in reply.json()["error"]["message"]


def test_fan_out_serves_each_choice_as_its_own_request() -> None:
    """A backend without groups (``choices.fan_out``): choice i is ``<id>-c<i>`` with its own seed."""
    sent: list[GenerationRequest] = []

    class Recording:
        def generate(self, request: GenerationRequest) -> Any:
            sent.append(request)
            return request

    request = generation("hello", 5, max_tokens=4)
    assert fan_out(Recording(), request, 3) == sent  # type: ignore[arg-type]
    assert [(r.request_id, r.sampling.seed) for r in sent] == [
        (f"{request.request_id}-c{i}", choice_seed(5, i)) for i in range(3)]
    assert sent[0].sampling.seed == 5 and fan_out(Recording(), request, 1) == [request]  # type: ignore[arg-type]
