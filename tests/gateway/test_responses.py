"""``/v1/responses`` through the real ``openai`` client: text, instructions, limits, formats, storage.

The session's gateway serves the plain fake model; the fake backend echoes the last user turn,
so the reply says which turn the model saw last, and ``/prefills`` shows the whole prompt it
got (decoded with the fake tokenizer). Every object and stream event is also validated against
the SDK's own pydantic models (``strictly``), so a field the SDK needs is never missing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from .fake_tokenizer import FakeTokenizer
from .in_process import InProcessGateway
from .support import FakeBackend, Gateway
from .test_disconnect import abort_for, wait_for_event

TOKENIZER = FakeTokenizer()
STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def strictly(response: Any) -> Response:
    """``response`` as the SDK's model would validate it (not just construct it)."""
    return Response.model_validate(response.to_dict() if hasattr(response, "to_dict") else response)


def prompt_text(backend: FakeBackend, response_id: str) -> str:
    [prefill] = [p for p in backend.get("/prefills") if p["request_id"] == response_id]
    return TOKENIZER.decode(prefill["token_ids"], skip_special_tokens=False)


def prefill_of(backend: FakeBackend, response_id: str) -> dict[str, Any]:
    [prefill] = [p for p in backend.get("/prefills") if p["request_id"] == response_id]
    return prefill


def test_string_input(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    response = client.responses.create(model=model, input="fresh words!")
    strictly(response)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == model
    assert (response.status, response.incomplete_details, response.error) == ("completed", None, None)
    assert response.output_text == "fresh words!"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_")
    assert [(c.type, c.text, c.annotations) for c in message.content] == [("output_text", "fresh words!", [])]
    usage = response.usage
    assert usage is not None
    assert usage.input_tokens == len(TOKENIZER.encode(TOKENIZER.apply_chat_template(
        [{"role": "user", "content": "fresh words!"}])))
    assert (usage.output_tokens, usage.total_tokens) == (7, usage.input_tokens + 7)  # 6 pair tokens + end of turn
    # No earlier request of the session sent this prompt: nothing of it is in the prefix cache.
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert prompt_text(backend, response.id) == "<|im_start|>user\nfresh words!<|im_end|>\n<|im_start|>assistant\n"


def test_item_input_and_instructions(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    response = client.responses.create(model=model, instructions="Answer briefly.", input=[
        {"role": "user", "content": "first question"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "first answer"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "second "}, {"type": "input_text", "text": "one"}]},
    ])
    assert response.output_text == "second one"
    assert response.instructions == "Answer briefly."
    assert prompt_text(backend, response.id) == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nfirst question<|im_end|>\n"
        "<|im_start|>assistant\nfirst answer<|im_end|>\n<|im_start|>user\nsecond one<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_max_output_tokens_makes_an_incomplete_response(client: openai.OpenAI, model: str,
                                                        backend: FakeBackend) -> None:
    response = client.responses.create(model=model, input="#loop abcd", max_output_tokens=5)
    strictly(response)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"  # type: ignore[union-attr]
    assert response.output_text == "abcdabcdab" and response.usage is not None and response.usage.output_tokens == 5
    assert prefill_of(backend, response.id)["max_tokens"] == 5


def test_sampling_reaches_the_backend(client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    response = client.responses.create(model=model, input="hi", temperature=0.25, top_p=0.5)
    prefill = prefill_of(backend, response.id)
    assert (prefill["temperature"], prefill["top_p"]) == (0.25, 0.5)
    assert (response.temperature, response.top_p) == (0.25, 0.5)


def test_a_json_schema_format_reaches_the_backend_as_a_constraint(client: openai.OpenAI, model: str,
                                                                  backend: FakeBackend) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    response = client.responses.create(model=model, input='{"city": "Paris"}', text={"format": {
        "type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    assert response.output_text == '{"city": "Paris"}'
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"
    constraint = prefill_of(backend, response.id)["constraint"]
    assert constraint is not None and "city" in constraint["jsonSchema"]
    response = client.responses.create(model=model, input="{}", text={"format": {"type": "json_object"}})
    assert prefill_of(backend, response.id)["constraint"] == {"jsonObject": True}
    response = client.responses.create(model=model, input="plain", text={"format": {"type": "text"}})
    assert prefill_of(backend, response.id)["constraint"] is None


def test_streaming_events_in_order(client: openai.OpenAI, model: str) -> None:
    events = list(client.responses.create(model=model, input="#batch=3 streaming works", stream=True))
    for event in events:
        STREAM_EVENT.validate_python(event.to_dict())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert deltas > 1, "text streams in pieces"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "streaming works"
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == "streaming works" and final.status == "completed"
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}  # type: ignore[union-attr]
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}  # type: ignore[union-attr]
    assert item_ids == {final.output[0].id}


def test_the_stream_helper_gives_the_final_response(client: openai.OpenAI, model: str) -> None:
    with client.responses.stream(model=model, input="#loop xy", max_output_tokens=3) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response() if "response.completed" in kinds else None
    assert kinds[-1] == "response.incomplete" and final is None
    with client.responses.stream(model=model, input="helper") as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == "helper"


@pytest.fixture(scope="module")
def impatient_gateway(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway that gives up after two placements in a row failed."""
    gw = InProcessGateway(tmp_path_factory.mktemp("impatient"), backend.address, migration_retries=2)
    gw.start_gateway()
    yield gw
    assert gw.stop() == 0


def test_a_failure_after_the_stream_started_is_a_failed_event(impatient_gateway: Gateway, model: str) -> None:
    # Two tokens arrive, decode dies, and every placement after that fails.
    with openai.OpenAI(base_url=f"{impatient_gateway.url}/v1", api_key="unused", max_retries=0, timeout=20) as client:
        events = list(client.responses.create(model=model, input=f"#loop #fail_after=1 #stuck_after=2 {uuid.uuid4()}",
                                              stream=True))
    for event in events:
        STREAM_EVENT.validate_python(event.to_dict())
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].code == "backend_unavailable"  # type: ignore[union-attr]
    failed = events[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "server_error"
    [message] = failed.output
    assert message.status == "incomplete" and len(message.content[0].text) == 4  # type: ignore[union-attr]  # 2 tokens
    assert "response.completed" not in [e.type for e in events]


def test_stored_responses_chain_with_previous_response_id(client: openai.OpenAI, model: str,
                                                          backend: FakeBackend) -> None:
    first = client.responses.create(model=model, instructions="Be terse.", input="my name is Ada")
    second = client.responses.create(model=model, previous_response_id=first.id, input="what is my name")
    third = client.responses.create(model=model, previous_response_id=second.id, input="and again",
                                    instructions="Be kind.")
    assert third.previous_response_id == second.id
    assert prompt_text(backend, third.id) == (
        "<|im_start|>system\nBe kind.<|im_end|>\n"  # instructions are not carried over
        "<|im_start|>user\nmy name is Ada<|im_end|>\n<|im_start|>assistant\nmy name is Ada<|im_end|>\n"
        "<|im_start|>user\nwhat is my name<|im_end|>\n<|im_start|>assistant\nwhat is my name<|im_end|>\n"
        "<|im_start|>user\nand again<|im_end|>\n<|im_start|>assistant\n")
    stored = client.responses.retrieve(second.id)
    strictly(stored)
    assert stored.to_dict() == second.to_dict()
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(second.id)
    # A chain keeps working after a response it was built on is deleted.
    fourth = client.responses.create(model=model, previous_response_id=third.id, input="last")
    assert "my name is Ada" in prompt_text(backend, fourth.id)


def test_a_streamed_response_is_stored_before_it_completes(client: openai.OpenAI, model: str) -> None:
    events = list(client.responses.create(model=model, input="streamed and stored", stream=True))
    final = events[-1].response  # type: ignore[union-attr]
    assert client.responses.retrieve(final.id).output_text == "streamed and stored"


def test_store_false_is_not_retrievable(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(model=model, input="forget me", store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=model, input="hi", previous_response_id=response.id)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_metadata_and_ignored_fields_are_accepted(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(
        model=model, input="hi", metadata={"team": "search"}, user="u-1", parallel_tool_calls=True,
        reasoning={"summary": "auto"}, truncation="disabled", service_tier="auto", safety_identifier="s",
        prompt_cache_key="k", text={"verbosity": "low"}, include=[], top_logprobs=0,
        tools=[{"type": "function", "name": "lookup", "parameters": {"type": "object"}, "strict": False}],
        tool_choice="none")
    strictly(response)
    assert response.output_text == "hi" and response.metadata == {"team": "search"}


def post(gateway: Gateway, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/responses", json=body, timeout=10)


@pytest.mark.parametrize(("extra", "param", "code"), [
    ({"seed": 1}, "seed", "unsupported_parameter"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", None),  # chat's verdict on reasoning_effort
    ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"background": True}, "background", "unsupported_parameter"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "unsupported_parameter"),
    ({"top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
    ({"max_tool_calls": 2}, "max_tool_calls", "unsupported_parameter"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "invalid_value"),
    ({"tools": [{"type": "function", "name": "lookup"}]}, "tools", "unsupported_parameter"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"type": "object", "dependentSchemas": {"a": {}}}}}},
     "text.format", "unsupported_constraint"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format", "unsupported_parameter"),
    ({"max_output_tokens": 10_000}, "max_output_tokens", "context_length_exceeded"),
    ({"model": "other"}, "model", "model_not_found"),
    ({"input": [{"type": "computer_call"}]}, "input", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "invalid_value"),
], ids=lambda v: str(v) if isinstance(v, str) else None)
def test_refusals_name_the_parameter(gateway: Gateway, model: str, extra: dict[str, Any], param: str,
                                     code: str | None) -> None:
    reply = post(gateway, {"model": model, "input": "hi", **extra})
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert error["param"] == param and (code is None or error["code"] == code), error


def test_an_unknown_previous_response_is_a_404(gateway: Gateway, model: str) -> None:
    reply = post(gateway, {"model": model, "input": "hi", "previous_response_id": "resp_nope"})
    assert reply.status_code == 404
    assert reply.json()["error"]["param"] == "previous_response_id"
    assert "resp_nope" in reply.json()["error"]["message"]


def test_explicit_nulls_mean_absent(gateway: Gateway, model: str) -> None:
    nullable = ["instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
                "parallel_tool_calls", "text", "reasoning", "stream", "store", "previous_response_id", "metadata",
                "user", "truncation", "include", "top_logprobs", "service_tier", "background"]
    reply = post(gateway, {"model": model, "input": [{"role": "user", "content": "hi", "id": None}],
                           **dict.fromkeys(nullable)})
    assert reply.status_code == 200, reply.text
    assert reply.json()["output"][0]["content"][0]["text"] == "hi"
    strictly(reply.json())


def test_stream_framing_names_each_event(gateway: Gateway, model: str) -> None:
    body = {"model": model, "input": "framed", "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/responses", json=body, timeout=10) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        blocks = reply.read().decode().split("\n\n")
    assert blocks[-1] == "", "the stream ends after a whole event"
    for block in blocks[:-1]:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: "):])["type"] == event[len("event: "):]
    assert blocks[-2].startswith("event: response.completed\n"), "no [DONE] line: the final event ends it"


def test_retrieving_or_deleting_an_unknown_response_is_a_404(gateway: Gateway) -> None:
    for method in ("GET", "DELETE"):
        reply = httpx.request(method, f"{gateway.url}/v1/responses/resp_unknown", timeout=10)
        assert reply.status_code == 404 and "resp_unknown" in reply.json()["error"]["message"]


def test_delete_answers_what_it_deleted(client: openai.OpenAI, model: str, gateway: Gateway) -> None:
    response = client.responses.create(model=model, input="delete me")
    reply = httpx.delete(f"{gateway.url}/v1/responses/{response.id}", timeout=10)
    assert reply.json() == {"id": response.id, "object": "response.deleted", "deleted": True}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_goes_away_cancels_the_generation(gateway: Gateway, backend: FakeBackend, model: str,
                                                        stream: bool) -> None:
    body = {"model": model, "input": f"#loop #delay=0.05 endless {uuid.uuid4()}", "stream": stream}
    before = len(backend.get("/prefills"))
    with httpx.Client(timeout=10) as http:
        if stream:
            with http.stream("POST", f"{gateway.url}/v1/responses", json=body) as reply:
                deltas = 0
                for line in reply.iter_lines():
                    deltas += line == "event: response.output_text.delta"
                    if deltas == 3:
                        break
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{gateway.url}/v1/responses", json=body, timeout=0.5)
    request_id = backend.get("/prefills")[before]["request_id"]
    assert request_id.startswith("resp_")
    assert "cancelled" in wait_for_event(backend, request_id, "cancelled")
    assert abort_for(backend, request_id)["request_id"] == request_id
