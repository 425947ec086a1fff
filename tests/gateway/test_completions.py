"""``POST /v1/completions`` through the real ``openai`` client, as a user of the legacy API calls it.

The fake backend echoes a raw prompt's text (without control tokens), then end-of-turn; the fake
tokenizer makes a token of every two ASCII characters, so "hello world" is 6 tokens and its
reply 7 (the end-of-turn token counts, its text does not show).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from .fake_tokenizer import IM_END, MODEL_ID, VOCAB_SIZE, FakeTokenizer
from .in_process import InProcessGateway
from .support import FakeBackend, Gateway, served_salt

TOKENIZER = FakeTokenizer()
CONTEXT_WINDOW = 256  # the fake model's


def prefills_of(backend: FakeBackend, response_id: str) -> list[dict[str, Any]]:
    """What prefill received for each choice of a response, in choice order."""
    found = [p for p in backend.get("/prefills") if p["request_id"].startswith(f"{response_id}-")]
    return sorted(found, key=lambda p: int(p["request_id"].rsplit("-", 1)[1]))


def by_index(chunks: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts


def finishes(chunks: list[Any]) -> dict[int, str]:
    return {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason}


def test_string_prompt(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    reply = client.completions.create(model=model, prompt="hello world")
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion" and reply.model == model
    [choice] = reply.choices
    assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (0, "hello world", "stop", None)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (6, 7, 13)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    [prefill] = prefills_of(backend, reply.id)
    assert prefill["token_ids"] == TOKENIZER.encode("hello world"), "a raw prompt gets no chat template"


def test_streaming_with_usage(client: openai.OpenAI, model: str) -> None:
    stream = client.completions.create(model=model, prompt="#batch=3 streaming works", stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")
    assert {c.object for c in chunks} == {"text_completion"}
    assert by_index(chunks) == {0: "streaming works"}
    assert finishes(chunks) == {0: "stop"}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert [c for c in chunks if c.usage is not None] == [chunks[-1]]
    assert chunks[-1].usage.completion_tokens == 9  # 8 pair tokens + end-of-turn
    assert chunks[-1].usage.prompt_tokens == len(TOKENIZER.encode("#batch=3 streaming works"))


def test_streaming_without_usage_has_no_usage_chunk(gateway: Gateway) -> None:
    body = {"model": MODEL_ID, "prompt": "plain", "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=10) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert all("usage" not in e and e["choices"] for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == "plain"


def test_list_of_strings_is_one_choice_per_prompt(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    prompts = ["first prompt", "#delay=0.02 second", "third"]
    reply = client.completions.create(model=model, prompt=prompts, max_tokens=50)
    assert [(c.index, c.text, c.finish_reason) for c in reply.choices] == [
        (0, "first prompt", "stop"), (1, "second", "stop"), (2, "third", "stop")]
    assert reply.usage.prompt_tokens == sum(len(TOKENIZER.encode(p)) for p in prompts)
    assert reply.usage.completion_tokens == 7 + 4 + 4
    assert [p["token_ids"] for p in prefills_of(backend, reply.id)] == [TOKENIZER.encode(p) for p in prompts]

    stream = client.completions.create(model=model, prompt=prompts, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert by_index(chunks) == {0: "first prompt", 1: "second", 2: "third"}
    assert finishes(chunks) == {0: "stop", 1: "stop", 2: "stop"}
    assert chunks[-1].usage.completion_tokens == 15


def test_choices_are_generated_concurrently(client: openai.OpenAI, model: str) -> None:
    started = time.monotonic()
    reply = client.completions.create(model=model, prompt=["#delay=0.2 " + "ab" * 5] * 4)  # 1 s of decode each
    assert [c.text for c in reply.choices] == ["ab" * 5] * 4
    assert time.monotonic() - started < 2.5, "four generations of 1 s ran one after another"


def test_token_id_prompts(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    ids = TOKENIZER.encode("from token ids")
    reply = client.completions.create(model=model, prompt=ids)
    assert [c.text for c in reply.choices] == ["from token ids"]
    assert reply.usage.prompt_tokens == len(ids)
    assert prefills_of(backend, reply.id)[0]["token_ids"] == ids

    lists = [TOKENIZER.encode("one"), TOKENIZER.encode("and two")]
    reply = client.completions.create(model=model, prompt=lists)
    assert [(c.index, c.text) for c in reply.choices] == [(0, "one"), (1, "and two")]
    assert [p["token_ids"] for p in prefills_of(backend, reply.id)] == lists


def test_echo_puts_the_prompt_first(client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt=["say ", "it "], echo=True)
    assert [c.text for c in reply.choices] == ["say say ", "it it "]
    reply = client.completions.create(model=model, prompt=TOKENIZER.encode("ids "), echo=True)
    assert [c.text for c in reply.choices] == ["ids ids "]

    chunks = list(client.completions.create(model=model, prompt="abc", echo=True, stream=True))
    assert chunks[0].choices[0].text == "abc", "the first chunk is the echoed prompt"
    assert by_index(chunks) == {0: "abcabc"}


def test_stop_strings(client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt="one two three", stop=["two", "zzz"])
    assert reply.choices[0].text == "one " and reply.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=model, prompt="one two three", stop="thr", stream=True))
    assert by_index(chunks) == {0: "one two "} and finishes(chunks) == {0: "stop"}


def test_max_tokens_defaults_to_16(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    reply = client.completions.create(model=model, prompt="#loop ab")
    assert reply.choices[0].text == "ab" * 16 and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 16
    assert prefills_of(backend, reply.id)[0]["max_tokens"] == 16

    reply = client.completions.create(model=model, prompt="#loop ab", max_tokens=3)
    assert reply.choices[0].text == "ababab" and reply.usage.completion_tokens == 3


def test_the_default_max_tokens_shrinks_to_fit_the_context(client: openai.OpenAI, model: str) -> None:
    prompt = "#loop " + "xy" * (CONTEXT_WINDOW - 3 - 9)  # 3 tokens of directive: 9 tokens of room left
    reply = client.completions.create(model=model, prompt=prompt)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 9


def test_control_token_text_in_a_raw_prompt_is_the_control_token(
        client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    reply = client.completions.create(model=model, prompt="<|im_start|>hi<|im_end|>")
    assert reply.usage.prompt_tokens == 3
    assert prefills_of(backend, reply.id)[0]["token_ids"][-1] == IM_END


def test_extensions_reach_the_backend(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    reply = client.completions.create(
        model=model, prompt="hi", temperature=0.5, top_p=0.9, seed=7, max_tokens=4, user="user-42",
        extra_body={"top_k": 5, "cache_salt": "tenant-a", "ignore_eos": True},
    )
    prefill = prefills_of(backend, reply.id)[0]
    assert (prefill["temperature"], prefill["top_p"], prefill["top_k"], prefill["seed"]) == (0.5, pytest.approx(0.9), 5, 7)
    # cache_salt reaches prefill derived from the tenant's salt, not as the client wrote it.
    assert (prefill["cache_salt"], prefill["ignore_eos"], prefill["max_tokens"]) == (served_salt("tenant-a").hex(), True, 4)


NULLABLE = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "echo",
            "user", "cache_salt", "ignore_eos", "n", "best_of", "suffix", "logprobs", "presence_penalty",
            "frequency_penalty", "logit_bias"]


def test_explicit_null_means_absent(gateway: Gateway) -> None:
    body = {"model": MODEL_ID, "prompt": "hi there", **dict.fromkeys(NULLABLE)}
    reply = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"] == [{"index": 0, "text": "hi there", "finish_reason": "stop", "logprobs": None}]


def test_off_values_are_accepted(client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt="hi", n=1, best_of=1, logprobs=0, presence_penalty=0,
                                      frequency_penalty=0, logit_bias={})
    assert reply.choices[0].text == "hi"


@pytest.mark.parametrize(("extra", "param"), [
    ({"best_of": 3}, "best_of"),
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"suffix": " the end"}, "suffix"),
    ({"logprobs": 2, "echo": True}, "echo"),
], ids=lambda v: "-".join(v) if isinstance(v, dict) else v)
def test_what_is_not_implemented_is_refused_by_name(client: openai.OpenAI, model: str, extra: dict[str, Any],
                                                    param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt="hi", **extra)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param  # type: ignore[index]
    assert caught.value.body["code"] == "unsupported_parameter"  # type: ignore[index]


def test_penalties_and_logit_bias_reach_the_engines(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    client.completions.create(model=model, prompt="hi", presence_penalty=0.5, frequency_penalty=-1.0,
                              logit_bias={"40": -100})
    sent = backend.get("/prefills")[-1]
    assert (sent["presence_penalty"], sent["frequency_penalty"], sent["logit_bias"]) == (0.5, -1.0, {"40": -100.0})
    error = post_raw(client, {"logit_bias": {"nope": 1}})
    assert error["param"] == "logit_bias"


def post_raw(client: openai.OpenAI, extra: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_ID, prompt="hi", extra_body=extra)
    return caught.value.body  # type: ignore[return-value]


def post(gateway: Gateway, **body: Any) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL_ID, "prompt": "hi", **body}, timeout=10)


@pytest.mark.parametrize(("body", "status", "code", "param"), [
    ({"prompt": ""}, 400, "invalid_value", "prompt"),
    ({"prompt": []}, 400, "invalid_value", "prompt"),
    ({"prompt": ["ok", ""]}, 400, "invalid_value", "prompt"),
    ({"prompt": [[]]}, 400, "invalid_value", "prompt"),
    ({"prompt": [1, "a"]}, 400, "invalid_value", "prompt"),
    ({"prompt": [-1]}, 400, "invalid_value", "prompt"),
    ({"prompt": ["x"] * 129}, 400, "invalid_value", "prompt"),
    ({"prompt": None}, 400, "invalid_value", "prompt"),
    ({"prompt": [VOCAB_SIZE]}, 400, "invalid_value", "prompt"),
    ({"prompt": [[5], [7, 2**31 - 1]]}, 400, "invalid_value", "prompt"),
    ({"prompt": "x" * 600}, 400, "context_length_exceeded", "prompt"),
    ({"max_tokens": CONTEXT_WINDOW}, 400, "context_length_exceeded", "max_tokens"),
    ({"max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ({"max_tokens": 2**31}, 400, "invalid_value", "max_tokens"),
    ({"seed": 2**63}, 400, "invalid_value", "seed"),
    ({"stop": ""}, 400, "invalid_value", "stop"),
    ({"echo": "yes"}, 400, "invalid_value", "echo"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "unsupported_parameter", "messages"),
    ({"model": "gpt-3.5-turbo-instruct"}, 404, "model_not_found", "model"),
], ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else str(v))
def test_bad_requests_name_the_field(gateway: Gateway, body: dict[str, Any], status: int, code: str,
                                     param: str) -> None:
    reply = post(gateway, **body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert error["message"]


def test_out_of_vocabulary_and_overflow_messages_say_which_prompt(gateway: Gateway) -> None:
    error = post(gateway, prompt=[[5], [VOCAB_SIZE + 3]]).json()["error"]
    assert "prompt[1]" in error["message"] and str(VOCAB_SIZE + 3) in error["message"]
    error = post(gateway, prompt=["fine", "x" * 600]).json()["error"]
    assert "prompt[1]" in error["message"] and f"{CONTEXT_WINDOW} tokens" in error["message"]


def test_sdk_errors_for_a_stream_come_before_it_starts(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=[TOKENIZER.encode("ok"), [VOCAB_SIZE]], stream=True)
    assert caught.value.body["param"] == "prompt"  # type: ignore[index]


def metric(gateway: Gateway, status: str) -> float:
    prefix = f'crescent_gateway_requests_total{{status="{status}"}} '
    text = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    return sum(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


def test_client_errors_are_counted(gateway: Gateway) -> None:
    before = metric(gateway, "client_error")
    post(gateway, prompt=[])          # refused before the handler ran
    post(gateway, prompt=[VOCAB_SIZE])  # refused by it
    assert metric(gateway, "client_error") == before + 2


def wait_until_freed(backend: FakeBackend, request_id: str, timeout_s: float = 2.0) -> None:
    """Decode let the request go: its stream cancelled, or (not opened yet) its handoff aborted."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = [e["event"] for e in backend.get("/decode-events") if e["request_id"] == request_id]
        if {"cancelled", "aborted"} & set(events):
            assert request_id not in backend.get("/jobs")
            return
        assert time.monotonic() < deadline, f"decode did not free {request_id}: {events}"
        time.sleep(0.02)


def test_a_client_that_goes_away_cancels_every_choice(gateway: Gateway, backend: FakeBackend) -> None:
    body = {"model": MODEL_ID, "prompt": ["#loop #delay=0.05 one ", "#loop #delay=0.05 two "], "stream": True,
            "max_tokens": 200}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=10) as reply:
        first = json.loads(next(reply.iter_lines())[len("data: "):])
    for index in (0, 1):
        wait_until_freed(backend, f"{first['id']}-{index}")


@pytest.fixture(scope="module")
def impatient_gateway(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway that gives up after two placements in a row failed."""
    gw = InProcessGateway(tmp_path_factory.mktemp("impatient"), backend.address, migration_retries=2)
    gw.start_gateway()
    yield gw
    assert gw.stop() == 0


def test_a_choice_that_fails_mid_stream_ends_every_open_choice_with_an_error(
        impatient_gateway: Gateway, backend: FakeBackend) -> None:
    # Choice 0: two tokens arrive, decode dies, and every placement after that fails.
    body = {"model": MODEL_ID, "prompt": ["#loop #fail_after=1 #stuck_after=2 abcd", "#loop #delay=0.05 endless "],
            "stream": True, "max_tokens": 200}
    with httpx.stream("POST", f"{impatient_gateway.url}/v1/completions", json=body, timeout=20) as reply:
        assert reply.status_code == 200
        lines = [line[len("data: "):] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    last = json.loads(lines[-2])
    assert {(c["index"], c["finish_reason"]) for c in last["choices"]} == {(0, "error"), (1, "error")}
    assert last["error"]["code"] == "backend_unavailable"
    delivered = "".join(c["text"] for line in lines[:-2] for c in json.loads(line)["choices"] if c["index"] == 0)
    assert delivered == "abcd"
    wait_until_freed(backend, f"{last['id']}-1")

    with pytest.raises(openai.APIError):  # the SDK raises the error event
        with openai.OpenAI(base_url=f"{impatient_gateway.url}/v1", api_key="unused", max_retries=0) as client:
            list(client.completions.create(model=MODEL_ID, prompt="#loop #fail_after=1 #stuck_after=2 abcd",
                                           stream=True, max_tokens=200))
