"""The sampling parameters and output constraints a chat request carries to the engines.

The fake backend records the ``SamplingParams`` prefill received: each accepted parameter must
arrive as sent, and every constraint the grammar engine cannot enforce must be a 400 naming it
before anything is placed (never a silent unconstrained run). What the engines do with them is
tested against real models in tests/engine and tests/e2e.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pydantic
import pytest

from .fake_tokenizer import MODEL_ID
from .support import FakeBackend, Gateway

USER = [{"role": "user", "content": "hi"}]


def sent(backend: FakeBackend) -> dict[str, Any]:
    return backend.get("/prefills")[-1]


def test_penalties_bias_and_min_tokens_reach_the_engines(client: openai.OpenAI, model: str,
                                                          backend: FakeBackend) -> None:
    client.chat.completions.create(
        model=model, messages=USER, presence_penalty=0.5, frequency_penalty=-1.0, logit_bias={"40": 5, "41": -100},
        extra_body={"repetition_penalty": 1.2, "min_tokens": 3, "stop_token_ids": [77]},  # type: ignore[arg-type]
    )
    got = sent(backend)
    assert got["presence_penalty"] == 0.5 and got["frequency_penalty"] == -1.0
    assert got["repetition_penalty"] == pytest.approx(1.2)
    assert got["logit_bias"] == {"40": 5.0, "41": -100.0}
    assert got["min_tokens"] == 3
    assert 77 in got["stop_token_ids"]
    assert got["constraint"] is None


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_parse_with_a_pydantic_model_sends_its_schema(client: openai.OpenAI, model: str,
                                                      backend: FakeBackend) -> None:
    # The fake backend echoes the user's text: a JSON reply the SDK parses into the model.
    reply = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": '{"name": "Ada", "age": 36}'}], response_format=Person,
    )
    assert reply.choices[0].message.parsed == Person(name="Ada", age=36)
    schema = json.loads(sent(backend)["constraint"]["jsonSchema"])
    assert schema["required"] == ["name", "age"] and schema["additionalProperties"] is False


@pytest.mark.parametrize(("extra", "constraint"), [
    ({"response_format": {"type": "json_object"}}, {"jsonObject": True}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": {"choices": ["yes", "no"]}}),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, {"grammar": 'start: "a"+'}),
], ids=["json_object", "regex", "choice", "grammar"])
def test_constraints_reach_the_engines(client: openai.OpenAI, model: str, backend: FakeBackend,
                                       extra: dict[str, Any], constraint: dict[str, Any]) -> None:
    client.chat.completions.create(model=model, messages=USER, extra_body=extra)  # type: ignore[arg-type]
    assert sent(backend)["constraint"] == constraint


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"when": {"type": "string", "format": "lunar-date"}}}}}},
     "response_format.json_schema", "lunar-date"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#/$defs/missing"}}}}, "response_format.json_schema", "missing"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs", "look-around"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs", "undefined_rule"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop", "stop strings"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ends where"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"5": 500}}, "logit_bias", "100"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"min_tokens": -1}, "min_tokens", "greater than or equal"),
])
def test_what_cannot_be_enforced_is_a_400_before_placement(gateway: Gateway, backend: FakeBackend,
                                                           body: dict[str, Any], param: str, says: str) -> None:
    places = len(backend.get("/places"))
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": MODEL_ID, "messages": USER, **body},
                       timeout=10)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"].startswith(param) and says in error["message"], error
    assert len(backend.get("/places")) == places
