"""Reasoning and tool calls through the real gateway process and the real ``openai`` client.

The gateway serves ``fake_tool_model`` (Kimi's output format, a fake tokenizer that splits every
tag over several tokens); the fake backend replies with the last user message, which scripts
the token stream. A model with no tool format at all (the session's plain fake model) refuses
tools with a 400 that names the parameter; SmolLM2 gets the default format (``test_default_tools``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .fake_tool_model import TOOL_MODEL_ID, FakeToolTokenizer
from .in_process import InProcessGateway
from .support import PRODUCTION_ENTRY, FakeBackend, Gateway

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]
THINK = "<think>The user wants the weather; I should call the tool.</think>"
REASONING = "The user wants the weather; I should call the tool."
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def call(call_id: str, arguments: dict[str, Any]) -> str:
    return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{json.dumps(arguments)}<|tool_call_end|>"


TWO_CALLS = THINK + SECTION_BEGIN + call("functions.get_weather:0", {"city": "Paris"}) + \
    call("functions.get_weather:1", {"city": "Oslo"}) + SECTION_END


@pytest.fixture(scope="module")
def tool_gateway(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = InProcessGateway(tmp_path_factory.mktemp("tool-gateway"), backend.address,
                         entry=("-m", "tests.gateway.fake_tool_model"))
    gw.start_gateway()
    yield gw
    assert gw.stop() == 0, "the gateway did not stop cleanly"


@pytest.fixture
def tool_client(tool_gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{tool_gateway.url}/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_reasoning_is_separated_from_the_answer(tool_client: openai.OpenAI) -> None:
    reply = tool_client.chat.completions.create(model=TOOL_MODEL_ID, messages=user(THINK + "It is sunny."))
    message = reply.choices[0].message
    assert message.reasoning_content == REASONING  # type: ignore[attr-defined]
    assert message.content == "It is sunny."
    assert message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


def test_reasoning_streams_as_reasoning_content(tool_client: openai.OpenAI) -> None:
    stream = tool_client.chat.completions.create(
        model=TOOL_MODEL_ID, messages=user("#batch=3 " + THINK + "It is sunny."), stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    reasoning = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    content = [d.content for d in deltas if d.content]
    assert "".join(reasoning) == REASONING
    assert len(reasoning) > 1, "reasoning streams in pieces, not all at the end"
    assert "".join(content) == "It is sunny."
    kinds = ["r" if getattr(d, "reasoning_content", None) else "c" for d in deltas if d.content or
             getattr(d, "reasoning_content", None)]
    assert kinds == sorted(kinds, reverse=True), "all reasoning comes before the answer"


def test_tool_calls_non_streaming(tool_client: openai.OpenAI) -> None:
    reply = tool_client.chat.completions.create(model=TOOL_MODEL_ID, messages=user(TWO_CALLS), tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == REASONING  # type: ignore[attr-defined]
    calls = choice.message.tool_calls
    assert calls is not None
    assert [(c.id, c.type, c.function.name) for c in calls] == [
        ("functions.get_weather:0", "function", "get_weather"), ("functions.get_weather:1", "function", "get_weather")]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]


def test_tool_calls_streaming(tool_client: openai.OpenAI) -> None:
    script = "Checking. " + SECTION_BEGIN + call("functions.get_weather:0", {"city": "Paris"}) + \
        call("functions.get_weather:1", {"city": "Oslo"}) + SECTION_END
    stream = tool_client.chat.completions.create(
        model=TOOL_MODEL_ID, messages=user(script), tools=TOOLS, tool_choice="auto", stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking. "
    assembled: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for tc in chunk.choices[0].delta.tool_calls or ():
            if tc.index not in assembled:  # the first delta of a call names it
                assert tc.id and tc.type == "function" and tc.function and tc.function.name
                assembled[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and (tc.function is None or tc.function.name is None)
            assembled[tc.index]["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert sorted(assembled) == [0, 1]
    assert [json.loads(assembled[i]["arguments"]) for i in (0, 1)] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert assembled[1]["id"] == "functions.get_weather:1"
    argument_chunks = sum(1 for c in chunks for tc in c.choices[0].delta.tool_calls or () if tc.id is None)
    assert argument_chunks > 2, "arguments stream as they are generated"
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_tools_are_rendered_into_the_prompt_and_history_round_trips(tool_client: openai.OpenAI) -> None:
    tokenizer = FakeToolTokenizer()
    first = tool_client.chat.completions.create(model=TOOL_MODEL_ID, messages=user(TWO_CALLS), tools=TOOLS)
    rendered = tokenizer.apply_chat_template(user(TWO_CALLS), tools=TOOLS)
    assert first.usage is not None and first.usage.prompt_tokens == len(tokenizer.encode(rendered))
    # The client appends the assistant turn as returned, then the tool results, and asks again.
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    results = [{"role": "tool", "tool_call_id": c.id, "content": '{"sky": "clear"}'}
               for c in first.choices[0].message.tool_calls or ()]
    history = [*user(TWO_CALLS), assistant, *results, *user("Thanks")]
    second = tool_client.chat.completions.create(model=TOOL_MODEL_ID, messages=history, tools=TOOLS)
    assert second.choices[0].message.content == "Thanks"
    expected = [*user(TWO_CALLS), {"role": "assistant", "content": None, "reasoning_content": REASONING,
                                   "tool_calls": assistant["tool_calls"]}, *results, *user("Thanks")]
    assert second.usage is not None
    assert second.usage.prompt_tokens == len(tokenizer.encode(tokenizer.apply_chat_template(expected, tools=TOOLS)))


def test_tool_markup_stays_text_when_the_request_offers_no_tools(tool_client: openai.OpenAI) -> None:
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        reply = tool_client.chat.completions.create(model=TOOL_MODEL_ID, messages=user(TWO_CALLS), **extra)
        assert reply.choices[0].finish_reason == "stop"
        assert reply.choices[0].message.tool_calls is None
        assert reply.choices[0].message.content == TWO_CALLS[len(THINK):]


def test_a_tool_call_cut_by_max_tokens_finishes_with_length(tool_client: openai.OpenAI) -> None:
    text = SECTION_BEGIN + call("functions.get_weather:0", {"city": "Paris"}) + SECTION_END
    reply = tool_client.chat.completions.create(model=TOOL_MODEL_ID, messages=user(text), tools=TOOLS, max_tokens=30)
    assert reply.choices[0].finish_reason == "length"


def refused(url: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


def test_forcing_a_tool_call_is_written_in_kimi_markup(tool_client: openai.OpenAI, backend: FakeBackend) -> None:
    tool_client.chat.completions.create(model=TOOL_MODEL_ID, messages=user("hi"), tools=TOOLS, tool_choice="required")
    grammar = backend.get("/prefills")[-1]["constraint"]["grammar"]
    assert grammar.startswith("start: <|tool_calls_section_begin|> call+ <|tool_calls_section_end|>")
    assert '"functions.get_weather:" /[0-9]{1,3}/ <|tool_call_argument_begin|>' in grammar


def test_forcing_needs_an_offered_tool(tool_gateway: Gateway) -> None:
    error = refused(tool_gateway.url, {"model": TOOL_MODEL_ID, "messages": user("hi"), "tool_choice": "required"})
    assert error["param"] == "tool_choice"
    error = refused(tool_gateway.url, {"model": TOOL_MODEL_ID, "messages": user("hi"),
                                       "tools": [{"type": "function", "function": {"name": "bad name!"}}]})
    assert error["param"] == "tools[0].function.name"


def test_models_without_tool_support_refuse_tools(gateway: Gateway, model: str) -> None:
    error = refused(gateway.url, {"model": model, "messages": user("hi"), "tools": TOOLS})
    assert (error["param"], error["code"]) == ("tools", "unsupported_parameter")
    assert "no tool support" in error["message"]
    history = [*user("hi"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]
    error = refused(gateway.url, {"model": model, "messages": history})
    assert (error["param"], error["code"]) == ("messages", "unsupported_parameter")


KIMI_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "kimi-tokenizer"


@pytest.mark.skipif(not (KIMI_DIR / "tiktoken.model").is_file(), reason=f"no Kimi vocabulary at {KIMI_DIR}")
def test_a_kimi_token_stream_parses_into_reasoning_and_tool_calls() -> None:
    # With the real vocabulary the tags are single tokens; they must reach the parsers as text.
    from crescent.services.model.kimi_tokenizer import KimiTokenizer
    from crescent.services.gateway.parsing.assistant_output import AssistantOutputParser, ReasoningDelta, ToolCallDelta
    from crescent.services.gateway.generation import TextDelta
    from crescent.services.gateway.parsing.output_format import KIMI_OUTPUT

    tokenizer = KimiTokenizer.from_dir(KIMI_DIR)
    ids = tokenizer.encode(TWO_CALLS + "<|im_end|>")
    assert tokenizer.token_to_id("<|tool_call_begin|>") in ids
    detokenizer, parser = tokenizer.new_detokenizer(), AssistantOutputParser(KIMI_OUTPUT)
    events = [e for i in ids if i not in tokenizer.eos_token_ids for e in parser.push(detokenizer.push(i))]
    events += parser.finish()
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == REASONING
    assert not [e for e in events if isinstance(e, TextDelta)]
    headers = [(e.call_id, e.name) for e in events if isinstance(e, ToolCallDelta) and e.call_id]
    assert headers == [("functions.get_weather:0", "get_weather"), ("functions.get_weather:1", "get_weather")]
    assert parser.completed_tool_calls == 2


@pytest.mark.skipif(not (KIMI_DIR / "tiktoken.model").is_file(), reason=f"no Kimi vocabulary at {KIMI_DIR}")
def test_the_gateway_serves_kimi_k3_nano_with_the_k3_chat_format(
        backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> None:
    from crescent.services.model.kimi_tokenizer import tokenizer_for
    from crescent.services.model.model_source import resolve_model

    gw = InProcessGateway(tmp_path_factory.mktemp("kimi"), backend.address, entry=PRODUCTION_ENTRY,
                          model="kimi-k3-nano")
    gw.start_gateway()
    try:
        with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
            reply = client.chat.completions.create(model="kimi-k3-nano", messages=user("Hi"), tools=TOOLS)
    finally:
        assert gw.stop() == 0
    tokenizer = tokenizer_for(resolve_model("kimi-k3-nano"))
    expected = tokenizer.encode(tokenizer.apply_chat_template(user("Hi"), tools=TOOLS))
    assert reply.usage is not None and reply.usage.prompt_tokens == len(expected)
    sent = backend.get("/prefills")[-1]
    assert sent["token_ids"] == expected
    assert sorted(sent["stop_token_ids"]) == [163585, 163586]  # [EOS], <|end_of_msg|>
