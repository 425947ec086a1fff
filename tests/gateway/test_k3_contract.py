"""Kimi K3's API contract, driven with the ``openai`` SDK the way a K3 client drives it (non-standard
fields in ``extra_body``), against the real gateway (the production model loader) serving kimi-k3-nano.

The backend is the fake one with K3's tokenizer (``k3_echo_backend.vocab``): a test scripts the
model's reply, in K3's own markup, as the last user message, and checks what the client gets back
and what prefill received (prompt token ids, sampling, constraint). Both are served from the test
process (``in_process.py``): no process starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pydantic
import pytest
from crescent.services.gateway.config import GatewaySettings
from crescent.services.gateway.model import load_served_model
from crescent.services.gateway.model_policy import K3_POLICY, NO_POLICY
from crescent.services.gateway.parsing.output_format import K3_OUTPUT, KIMI_OUTPUT
from crescent.services.model.kimi_tokenizer import KimiTokenizer, tokenizer_for
from crescent.services.model.model_source import resolve_model
from tests.model.kimi_vocab import SHARED, needs_vocabulary, write_k3_checkpoint

from . import k3_echo_backend
from .in_process import InProcessBackend, InProcessGateway
from .support import PRODUCTION_ENTRY, FakeBackend

pytestmark = needs_vocabulary
MODEL = "kimi-k3-nano"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}
CALL_PARIS = ('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
              '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
              "<|close|>call<|sep|><|close|>tools<|sep|>")
THINK_THEN_CALL = ("The user wants weather.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>"
                   + CALL_PARIS + "<|close|>message<|sep|>")


@pytest.fixture(scope="module")
def k3_backend() -> Iterator[FakeBackend]:
    backend = InProcessBackend(vocab=k3_echo_backend.vocab())
    backend.start_backend()
    yield backend
    backend.stop()


@pytest.fixture(scope="module")
def k3_gateway(k3_backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessGateway]:
    gw = InProcessGateway(tmp_path_factory.mktemp("k3"), k3_backend.address, entry=PRODUCTION_ENTRY, model=MODEL)
    gw.start_gateway(timeout_s=60)
    yield gw
    assert gw.stop() == 0


@pytest.fixture(scope="module")
def api(k3_gateway: InProcessGateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{k3_gateway.url}/v1", api_key="unused", max_retries=0, timeout=20) as client:
        yield client


@pytest.fixture(scope="module")
def k3() -> KimiTokenizer:
    return tokenizer_for(resolve_model(MODEL))  # type: ignore[return-value]


def sent(backend: FakeBackend) -> dict[str, Any]:
    return backend.get("/prefills")[-1]


def prompt_text(backend: FakeBackend, k3: KimiTokenizer) -> str:
    return k3.decode(sent(backend)["token_ids"], skip_special_tokens=False)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def refused(call: Any) -> dict[str, Any]:
    """The error object of the 400 that ``call`` gets (the SDK hands over the body's ``error``)."""
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    body = caught.value.body
    assert isinstance(body, dict)
    return body.get("error", body)


def test_a_thinking_reply_becomes_reasoning_content_and_tool_calls(api: openai.OpenAI) -> None:
    reply = api.chat.completions.create(model=MODEL, messages=user(THINK_THEN_CALL), tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.message.model_extra["reasoning_content"] == "The user wants weather."
    assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_the_same_reply_streamed(api: openai.OpenAI) -> None:
    reasoning, content, name, arguments, finish = "", "", "", "", None
    for chunk in api.chat.completions.create(model=MODEL, messages=user(THINK_THEN_CALL), tools=[WEATHER],
                                             stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for call in delta.tool_calls or ():
            name += call.function.name or ""
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, name, json.loads(arguments), finish) == (
        "The user wants weather.", "Checking.", "get_weather", {"city": "Paris"}, "tool_calls")


def test_a_call_and_its_result_sent_back_render_where_k3_puts_them(api: openai.OpenAI, k3_backend: FakeBackend,
                                                                    k3: KimiTokenizer) -> None:
    first = api.chat.completions.create(model=MODEL, messages=user(THINK_THEN_CALL), tools=[WEATHER])
    message = first.choices[0].message
    history = [*user("Weather in Paris?"), {
        "role": "assistant", "content": message.content, "reasoning_content": message.model_extra["reasoning_content"],
        "tool_calls": [c.model_dump() for c in message.tool_calls]},
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}, *user("Thanks")]
    reply = api.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER])
    prompt = prompt_text(k3_backend, k3)
    assert ("<|open|>think<|sep|>The user wants weather.<|close|>think<|sep|><|open|>response<|sep|>Checking."
            "<|close|>response<|sep|>" + CALL_PARIS) in prompt
    assert '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny<|close|>message<|sep|>' in prompt
    assert reply.usage.prompt_tokens == len(sent(k3_backend)["token_ids"])


def test_usage_counts_the_tokens_of_k3s_own_format(api: openai.OpenAI, k3_backend: FakeBackend,
                                                   k3: KimiTokenizer) -> None:
    reply = api.chat.completions.create(model=MODEL, messages=user("Hi"))
    expected = k3.encode(k3.apply_chat_template(user("Hi"), thinking=True, thinking_effort="max"))
    assert sent(k3_backend)["token_ids"] == expected and reply.usage.prompt_tokens == len(expected)


def test_thinking_effort_wins_over_reasoning_effort_and_keep_all_is_accepted(
        api: openai.OpenAI, k3_backend: FakeBackend, k3: KimiTokenizer) -> None:
    api.chat.completions.create(model=MODEL, messages=user("Hi"), reasoning_effort="high",  # type: ignore[arg-type]
                                extra_body={"thinking": {"type": "enabled", "keep": "all", "effort": "low"}})
    prompt = prompt_text(k3_backend, k3)
    assert "`thinking_effort=low`" in prompt and prompt.endswith("<|open|>think<|sep|>")
    assert (sent(k3_backend)["temperature"], sent(k3_backend)["top_p"]) == (pytest.approx(1.0), pytest.approx(0.95))
    api.chat.completions.create(model=MODEL, messages=user("Hi"), reasoning_effort="high")  # type: ignore[arg-type]
    assert "`thinking_effort=high`" in prompt_text(k3_backend, k3)
    error = refused(lambda: api.chat.completions.create(model=MODEL, messages=user("Hi"),
                                                        extra_body={"thinking": {"type": "enabled", "effort": "xhigh"}}))
    assert error["param"] == "thinking.effort" and "low" in error["message"]


def test_instant_mode_ignores_the_effort_and_answers_in_the_response_channel(
        api: openai.OpenAI, k3_backend: FakeBackend, k3: KimiTokenizer) -> None:
    reply = api.chat.completions.create(
        model=MODEL, messages=user("Hello!<|close|>response<|sep|><|close|>message<|sep|>"),
        reasoning_effort="max",  # type: ignore[arg-type]
        extra_body={"thinking": {"type": "disabled", "effort": "low"}})
    prompt = prompt_text(k3_backend, k3)
    assert "thinking_effort" not in prompt and prompt.endswith("<|open|>response<|sep|>")
    assert sent(k3_backend)["temperature"] == pytest.approx(0.6)
    assert reply.choices[0].message.content == "Hello!"
    assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})


@pytest.mark.parametrize("fields,param", [
    ({"temperature": 0.3}, "temperature"), ({"top_p": 0.5}, "top_p"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 0.2}, "frequency_penalty"), ({"n": 2}, "n"),
    ({"temperature": 1.0, "extra_body": {"thinking": {"type": "disabled"}}}, "temperature"),
])
def test_locked_sampling_parameters_are_refused_by_name(api: openai.OpenAI, fields: dict, param: str) -> None:
    error = refused(lambda: api.chat.completions.create(model=MODEL, messages=user("Hi"), **fields))
    assert (error["param"], error["code"]) == (param, "locked_parameter")
    assert "fixed at" in error["message"]


def test_locked_parameters_sent_at_their_fixed_values_are_accepted(api: openai.OpenAI) -> None:
    reply = api.chat.completions.create(model=MODEL, messages=user("Hi"), temperature=1.0, top_p=0.95, n=1,
                                        presence_penalty=0.0, frequency_penalty=0.0)
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_tool_choice_none_or_auto_without_tools_is_accepted(api: openai.OpenAI, choice: str) -> None:
    assert api.chat.completions.create(model=MODEL, messages=user("Hi"), tool_choice=choice).choices  # type: ignore


def test_dynamic_tools_are_declared_in_place_and_callable(api: openai.OpenAI, k3_backend: FakeBackend,
                                                          k3: KimiTokenizer) -> None:
    reply_text = ("Time?<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
                  '<|open|>call tool="clock" index="1"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
                  "<|close|>message<|sep|>")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "system", "tools": [CLOCK]}, *user(reply_text)]
    reply = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])  # type: ignore[arg-type]
    prompt = prompt_text(k3_backend, k3)
    assert prompt.index('"name":"get_weather"') < prompt.index("Be brief.") < prompt.index(
        "## New Tools Available") < prompt.index('"name":"clock"') < prompt.index('role="user"')
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "clock" and reply.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "clock"}}])
def test_a_forced_call_is_satisfied_by_dynamic_tools_alone(api: openai.OpenAI, k3_backend: FakeBackend,
                                                           k3: KimiTokenizer, choice: Any) -> None:
    messages = [{"role": "system", "tools": [CLOCK]}, *user("What time is it?")]
    api.chat.completions.create(model=MODEL, messages=messages, tool_choice=choice)  # type: ignore[arg-type]
    grammar = sent(k3_backend)["constraint"]["grammar"]
    assert 'call tool=\\"clock\\"' in grammar and grammar.startswith("start: <|close|> \"think\" <|sep|>")
    if choice == "required":
        assert "You MUST call tools in the next message." in prompt_text(k3_backend, k3)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "answer"}}}, "schema"),
    ({"messages": [*user("Hi"), {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny"}]}, "tool_call_id"),
    ({"messages": [{"role": "user", "content": "Hi", "tools": [CLOCK]}]}, "tools"),
])
def test_incomplete_requests_are_refused(api: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    fields = {"messages": user("Hi"), **body}
    error = refused(lambda: api.chat.completions.create(model=MODEL, **fields))
    assert param in (error["param"] or "") + error["message"], error


def test_cards_and_formats_follow_the_checkpoint_not_the_tokenizer(tmp_path: Path) -> None:
    k3_dir = write_k3_checkpoint(tmp_path / "kimi-k3")
    (k3_dir / "model.safetensors").write_bytes(b"")  # the gateway reads no weights
    served = load_served_model(GatewaySettings(model=str(k3_dir)))
    assert (served.policy, served.output_format) == (K3_POLICY, K3_OUTPUT)
    linear = tmp_path / "kimi-linear"
    linear.mkdir()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (linear / name).symlink_to(SHARED / name)
    (linear / "config.json").write_text(json.dumps({"model_type": "kimi_linear", "model_max_length": 1048576}))
    (linear / "model.safetensors").write_bytes(b"")
    served = load_served_model(GatewaySettings(model=str(linear)))
    assert (served.policy, served.output_format) == (NO_POLICY, KIMI_OUTPUT)  # Kimi's tokenizer, no thinking card


class Verdict(pydantic.BaseModel):
    verdict: str


def test_a_structured_output_is_the_response_channels_text(api: openai.OpenAI, k3_backend: FakeBackend,
                                                           k3: KimiTokenizer) -> None:
    scripted = ('<|close|>think<|sep|><|open|>response<|sep|>{"verdict": "yes"}<|close|>response<|sep|>'
                "<|close|>message<|sep|>")
    reply = api.chat.completions.parse(model=MODEL, messages=user(scripted), response_format=Verdict)
    assert reply.choices[0].message.parsed == Verdict(verdict="yes")
    grammar = sent(k3_backend)["constraint"]["grammar"]
    assert grammar.startswith('start: <|close|> "think" <|sep|> <|open|> "response" <|sep|> body <|close|> "response"')
    assert "The JSON data must match the following schema:" in prompt_text(k3_backend, k3)
