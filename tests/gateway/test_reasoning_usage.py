"""Reasoning and cached tokens in the usage a client is told, as OpenAI reports them, through the
real gateway process and the real ``openai`` client, checked against the usage ledger's rows.

Chat completions carry ``usage.completion_tokens_details.reasoning_tokens`` (the non-streaming
body and the streamed usage chunk) and ``usage.prompt_tokens_details.cached_tokens``; the
Responses API carries ``usage.output_tokens_details.reasoning_tokens``. The gateway serves
``fake_tool_model`` (Kimi's ``<think>`` markup; the fake tokenizer splits text into pairs of
characters) and the fake backend echoes the last user message, then end-of-turn. The expected
reasoning count is worked out here from the tokenizer alone: the tokens up to and including the
one that completes ``</think>``. The ledger row is read back through ``/admin/usage`` as CSV.
"""

from __future__ import annotations

import csv
import io
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from .fake_tool_model import TOOL_MODEL_ID, FakeToolTokenizer
from .in_process import InProcessGateway
from .support import BLOCK_SIZE, FakeBackend, Gateway

ADMIN_KEY = "admin-" + uuid.uuid4().hex
TOKENIZER = FakeToolTokenizer()
THINK = "<think>The user asks about the sky; it is blue by Rayleigh scattering.</think>"
ANSWER = "The sky is blue."


def reasoning_tokens_of(reply: str) -> int:
    """Tokens of ``reply`` up to the one that completes ``</think>`` (all of them if it never closes)."""
    ids = TOKENIZER.encode(reply)
    for count in range(1, len(ids) + 1):
        if "</think>" in TOKENIZER.decode(ids[:count]):
            return count
    return len(ids)


def completion_tokens_of(reply: str) -> int:
    return len(TOKENIZER.encode(reply)) + 1  # the fake backend ends every reply with end-of-turn


@pytest.fixture(scope="module")
def gateway(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = InProcessGateway(tmp_path_factory.mktemp("reasoning-usage"), backend.address,
                         entry=("-m", "tests.gateway.fake_tool_model"), auth={"admin_key": ADMIN_KEY})
    gw.start_gateway()
    yield gw
    assert gw.stop() == 0, "the gateway did not stop cleanly"


def ledger_row(gw: Gateway, request_id: str) -> dict[str, int]:
    """The ledger's token counts for one request (committed before the client got its last bytes)."""
    reply = httpx.get(f"{gw.url}/admin/usage", params={"format": "csv"}, timeout=10,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert reply.status_code == 200, reply.text
    [row] = [r for r in csv.DictReader(io.StringIO(reply.text)) if r["request_id"] == request_id]
    assert row["status"] == "ok"
    return {name: int(row[name]) for name in ("prompt_tokens", "cached_tokens", "completion_tokens",
                                               "reasoning_tokens")}


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_chat_reports_reasoning_tokens_as_the_ledger_counts_them(client: openai.OpenAI, gateway: Gateway) -> None:
    reply = client.chat.completions.create(model=TOOL_MODEL_ID, messages=user(THINK + ANSWER))
    assert reply.choices[0].message.content == ANSWER
    usage = reply.usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.prompt_tokens_details is not None
    expected = reasoning_tokens_of(THINK + ANSWER)
    assert 0 < expected < usage.completion_tokens
    assert usage.completion_tokens_details.reasoning_tokens == expected
    assert usage.completion_tokens == completion_tokens_of(THINK + ANSWER)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert ledger_row(gateway, reply.id) == {
        "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens,
        "completion_tokens": usage.completion_tokens, "reasoning_tokens": expected}


def test_streamed_usage_chunk_counts_every_choices_reasoning(client: openai.OpenAI, gateway: Gateway) -> None:
    stream = client.chat.completions.create(
        model=TOOL_MODEL_ID, messages=user("#batch=3 " + THINK + ANSWER), n=2, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    [usage] = [c.usage for c in chunks if c.usage is not None]
    assert chunks[-1].usage is usage and chunks[-1].choices == []  # the usage chunk comes last
    assert usage.completion_tokens_details is not None and usage.prompt_tokens_details is not None
    per_choice = reasoning_tokens_of(THINK + ANSWER)
    assert usage.completion_tokens_details.reasoning_tokens == 2 * per_choice  # both choices reasoned alike
    assert usage.completion_tokens == 2 * completion_tokens_of(THINK + ANSWER)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    row = ledger_row(gateway, chunks[0].id)
    assert (row["reasoning_tokens"], row["completion_tokens"], row["prompt_tokens"]) == (
        usage.completion_tokens_details.reasoning_tokens, usage.completion_tokens, usage.prompt_tokens)


def test_reasoning_cut_short_is_all_reasoning(client: openai.OpenAI, gateway: Gateway) -> None:
    reply = client.chat.completions.create(model=TOOL_MODEL_ID, messages=user(THINK + ANSWER), max_tokens=6)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content in (None, "")
    usage = reply.usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens == usage.completion_tokens_details.reasoning_tokens == 6
    assert ledger_row(gateway, reply.id)["reasoning_tokens"] == 6


def test_a_reply_without_reasoning_reports_zero(client: openai.OpenAI, gateway: Gateway) -> None:
    reply = client.chat.completions.create(model=TOOL_MODEL_ID, messages=user(ANSWER))
    usage = reply.usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 0
    assert usage.completion_tokens == completion_tokens_of(ANSWER)
    assert ledger_row(gateway, reply.id)["reasoning_tokens"] == 0


def test_cached_tokens_are_reported_and_recorded(client: openai.OpenAI, gateway: Gateway) -> None:
    message = "a prompt long enough to fill several blocks of the prefix cache, " * 3
    cold = client.chat.completions.create(model=TOOL_MODEL_ID, messages=user(message), max_tokens=2)
    warm = client.chat.completions.create(model=TOOL_MODEL_ID, messages=user(message), max_tokens=2)
    assert cold.usage is not None and warm.usage is not None
    assert cold.usage.prompt_tokens_details is not None and warm.usage.prompt_tokens_details is not None
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached == warm.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE > 0  # the prompt's full blocks
    assert ledger_row(gateway, warm.id)["cached_tokens"] == cached


def test_responses_report_reasoning_tokens(client: openai.OpenAI, gateway: Gateway) -> None:
    response = client.responses.create(model=TOOL_MODEL_ID, input=THINK + ANSWER, store=False)
    assert response.output_text == ANSWER
    usage = response.usage
    assert usage is not None
    expected = reasoning_tokens_of(THINK + ANSWER)
    assert usage.output_tokens_details.reasoning_tokens == expected
    assert usage.output_tokens == completion_tokens_of(THINK + ANSWER)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    row = ledger_row(gateway, response.id)
    assert (row["reasoning_tokens"], row["completion_tokens"], row["prompt_tokens"], row["cached_tokens"]) == (
        expected, usage.output_tokens, usage.input_tokens, usage.input_tokens_details.cached_tokens)


def test_streamed_responses_report_reasoning_tokens(client: openai.OpenAI, gateway: Gateway) -> None:
    events = list(client.responses.create(model=TOOL_MODEL_ID, input="#batch=2 " + THINK + ANSWER,
                                          store=False, stream=True))
    [completed] = [e for e in events if e.type == "response.completed"]
    usage = completed.response.usage
    assert usage is not None
    assert usage.output_tokens_details.reasoning_tokens == reasoning_tokens_of(THINK + ANSWER)
    assert ledger_row(gateway, completed.response.id)["reasoning_tokens"] == usage.output_tokens_details.reasoning_tokens
