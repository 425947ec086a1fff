"""``/v1/responses`` with reasoning and function calls, through the real ``openai`` client.

The gateway serves ``fake_tool_model`` (Kimi's markup, tags split over several tokens); the
fake backend replies with the last user turn, so a test scripts the reply by sending it. The
prompt a follow-up produces is compared with the fake template's rendering of the chat
messages it stands for: the history of function calls, their outputs and the reasoning
reaches the model as a chat client's would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from .fake_tool_model import TOOL_MODEL_ID, FakeToolTokenizer
from .in_process import InProcessGateway
from .support import FakeBackend, Gateway
from .test_reasoning_tools import REASONING, SECTION_BEGIN, SECTION_END, THINK, TWO_CALLS, call
from .test_responses import STREAM_EVENT, strictly

TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "Current weather of a city",
                     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                    "required": ["city"]}, "strict": False}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
TOKENIZER = FakeToolTokenizer()


@pytest.fixture(scope="module")
def tool_gateway(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = InProcessGateway(tmp_path_factory.mktemp("responses-tools"), backend.address,
                         entry=("-m", "tests.gateway.fake_tool_model"))
    gw.start_gateway()
    yield gw
    assert gw.stop() == 0, "the gateway did not stop cleanly"


@pytest.fixture
def tool_client(tool_gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{tool_gateway.url}/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


def prompt_of(backend: FakeBackend, response_id: str) -> list[int]:
    [prefill] = [p for p in backend.get("/prefills") if p["request_id"] == response_id]
    return prefill["token_ids"]


def rendered(messages: list[dict[str, Any]], tools: list[Any] | None = CHAT_TOOLS) -> list[int]:
    return TOKENIZER.encode(TOKENIZER.apply_chat_template(messages, tools=tools))


def test_reasoning_is_an_item_before_the_message(tool_client: openai.OpenAI) -> None:
    response = tool_client.responses.create(model=TOOL_MODEL_ID, input=THINK + "It is sunny.")
    strictly(response)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content or ()] == [("reasoning_text", REASONING)]
    assert message.type == "message" and response.output_text == "It is sunny."


def test_function_calls_are_items(tool_client: openai.OpenAI) -> None:
    response = tool_client.responses.create(model=TOOL_MODEL_ID, input=TWO_CALLS, tools=TOOLS)
    strictly(response)
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["reasoning", "function_call", "function_call"]
    calls: list[Any] = response.output[1:]
    assert [(c.call_id, c.name, c.status) for c in calls] == [
        ("functions.get_weather:0", "get_weather", "completed"),
        ("functions.get_weather:1", "get_weather", "completed")]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c.id and c.id.startswith("fc_") for c in calls)
    assert response.output_text == ""
    assert response.tools[0].name == "get_weather"  # type: ignore[union-attr]


def test_parallel_tool_calls_false_keeps_the_first_call(tool_client: openai.OpenAI) -> None:
    response = tool_client.responses.create(model=TOOL_MODEL_ID, input=TWO_CALLS, tools=TOOLS,
                                            parallel_tool_calls=False)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.parallel_tool_calls is False


def test_function_calls_stream_their_arguments(tool_client: openai.OpenAI) -> None:
    script = "Checking. " + SECTION_BEGIN + call("functions.get_weather:0", {"city": "Paris"}) + \
        call("functions.get_weather:1", {"city": "Oslo"}) + SECTION_END
    events: list[Any] = list(tool_client.responses.create(model=TOOL_MODEL_ID, input=script, tools=TOOLS,
                                                          stream=True))
    for event in events:
        STREAM_EVENT.validate_python(event.to_dict())
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["message", "function_call", "function_call"]
    assert [getattr(i, "call_id", None) for i in added] == [None, "functions.get_weather:0", "functions.get_weather:1"]
    for index in (1, 2):
        deltas = [e.delta for e in events
                  if e.type == "response.function_call_arguments.delta" and e.output_index == index]
        assert len(deltas) > 1, "arguments stream as they are generated"
        [done] = [e for e in events if e.type == "response.function_call_arguments.done" and e.output_index == index]
        assert done.arguments == "".join(deltas)
        assert done.item_id == added[index].id
    final = events[-1]
    assert final.type == "response.completed"
    assert [json.loads(c.arguments) for c in final.response.output[1:]] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert final.response.output_text == "Checking. "


def test_reasoning_streams_before_the_calls(tool_client: openai.OpenAI) -> None:
    with tool_client.responses.stream(model=TOOL_MODEL_ID, input="#batch=3 " + TWO_CALLS, tools=TOOLS) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    reasoning = [k for k in kinds if k.startswith("response.reasoning_text")]
    assert reasoning[-1] == "response.reasoning_text.done" and len(reasoning) > 2
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.function_call_arguments.delta")
    assert [item.type for item in final.output] == ["reasoning", "function_call", "function_call"]


def _history_messages(first_calls: list[Any]) -> list[dict[str, Any]]:
    tool_calls = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                  for c in first_calls]
    results = [{"role": "tool", "tool_call_id": c.call_id, "content": '{"sky": "clear"}'} for c in first_calls]
    return [{"role": "user", "content": TWO_CALLS},
            {"role": "assistant", "content": None, "reasoning_content": REASONING, "tool_calls": tool_calls},
            *results, {"role": "user", "content": "Thanks"}]


def function_call_outputs(calls: list[Any]) -> list[dict[str, Any]]:
    return [{"type": "function_call_output", "call_id": c.call_id, "output": '{"sky": "clear"}'} for c in calls]


def test_function_call_outputs_follow_up_with_the_items_sent_back(tool_client: openai.OpenAI,
                                                                  backend: FakeBackend) -> None:
    first = tool_client.responses.create(model=TOOL_MODEL_ID, input=TWO_CALLS, tools=TOOLS)
    outputs = function_call_outputs(first.output[1:])
    sent_back = [item.to_dict() for item in first.output]  # reasoning and calls, as the SDK gave them
    second = tool_client.responses.create(model=TOOL_MODEL_ID, tools=TOOLS, input=[
        {"role": "user", "content": TWO_CALLS}, *sent_back, *outputs, {"role": "user", "content": "Thanks"}])
    assert second.output_text == "Thanks"
    assert prompt_of(backend, second.id) == rendered(_history_messages(first.output[1:]))


def test_function_call_outputs_follow_up_with_previous_response_id(tool_client: openai.OpenAI,
                                                                   backend: FakeBackend) -> None:
    first = tool_client.responses.create(model=TOOL_MODEL_ID, input=TWO_CALLS, tools=TOOLS)
    outputs = function_call_outputs(first.output[1:])
    second = tool_client.responses.create(model=TOOL_MODEL_ID, tools=TOOLS, previous_response_id=first.id,
                                          input=[*outputs, {"role": "user", "content": "Thanks"}])
    assert second.output_text == "Thanks"
    assert prompt_of(backend, second.id) == rendered(_history_messages(first.output[1:]))


def test_tool_choice_none_leaves_markup_as_text(tool_client: openai.OpenAI) -> None:
    response = tool_client.responses.create(model=TOOL_MODEL_ID, input=TWO_CALLS, tools=TOOLS, tool_choice="none")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == TWO_CALLS[len(THINK):]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"])
def test_forcing_a_call_answers_as_chat_does(tool_gateway: Gateway, choice: Any) -> None:
    script = SECTION_BEGIN + call("functions.get_weather:0", {"city": "Paris"}) + SECTION_END
    chat_choice = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice["name"]}}
    chat = httpx.post(f"{tool_gateway.url}/v1/chat/completions", timeout=10, json={
        "model": TOOL_MODEL_ID, "messages": [{"role": "user", "content": script}], "tools": CHAT_TOOLS,
        "tool_choice": chat_choice})
    reply = httpx.post(f"{tool_gateway.url}/v1/responses", timeout=10, json={
        "model": TOOL_MODEL_ID, "input": script, "tools": TOOLS, "tool_choice": choice})
    assert reply.status_code == chat.status_code, (reply.text, chat.text)
    if reply.status_code == 400:
        assert reply.json()["error"]["param"] == chat.json()["error"]["param"] == "tool_choice"
    else:
        strictly(reply.json())
        assert [item["type"] for item in reply.json()["output"]] == ["function_call"]
