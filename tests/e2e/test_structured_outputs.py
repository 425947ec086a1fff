"""Structured outputs and sampling rules through real processes, against single-process generation.

The OpenAI SDK's ``.parse()`` with a Pydantic model, streamed JSON schemas, choices, and
penalties with ``logit_bias`` run on the whole stack (gateway → scheduler → prefill → decode,
the constraint masking prefill's first token and every decode step); at temperature 0 each
reply must equal the same model generating in this process under the same constraint.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest
from crescent.protos import common_pb2
from crescent.services.engine.constraints import ConstraintCompiler
from crescent.services.engine.sampler import SamplingConfig
from crescent.services.model.model_source import DEFAULT_MODEL

pytestmark = pytest.mark.slow


class City(pydantic.BaseModel):
    name: str
    country: str
    population_millions: float


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def compiler(reference) -> ConstraintCompiler:
    engine, _ = reference
    return ConstraintCompiler.for_model(DEFAULT_MODEL, engine.config.vocab_size, engine.config.eos_token_ids)


def reference_text(reference, compiler, messages, max_tokens: int, constraint=None,
                   sampling: SamplingConfig = SamplingConfig()) -> tuple[str, str]:
    engine, tokenizer = reference
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    matcher = compiler.compile(constraint) if constraint is not None else None
    out = engine.generate(ids, max_tokens, sampling, constraint=matcher)
    eos = set(tokenizer.eos_token_ids)
    return tokenizer.decode([t for t in out if t not in eos]), "stop" if out[-1] in eos else "length"


def test_parse_returns_the_pydantic_object_the_reference_writes(stack, reference, compiler) -> None:
    messages = [{"role": "user", "content": "Describe Paris as JSON with name, country and population."}]
    reply = client(stack).chat.completions.parse(model=DEFAULT_MODEL, messages=messages, response_format=City,
                                                 temperature=0, max_tokens=60)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, City)
    schema = openai.lib._pydantic.to_strict_json_schema(City)
    text, finish = reference_text(reference, compiler, messages, 60,
                                  common_pb2.Constraint(json_schema=json.dumps(schema)))
    assert finish == "stop" and reply.choices[0].message.content == text


def test_streamed_schemas_validate(stack) -> None:
    schemas = [
        {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                     "minItems": 1, "maxItems": 3}},
         "required": ["colors"], "additionalProperties": False},
        {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1,
                                                                            "maximum": 9}},
         "required": ["ok", "n"], "additionalProperties": False},
        {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"why": {"type": "string", "maxLength": 20}},
                                          "required": ["why"], "additionalProperties": False}]},
    ]

    def stream(schema: dict) -> tuple[str, str | None]:
        chunks = client(stack).chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Pick some colors, in JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
            temperature=0.7, seed=4, max_tokens=48, stream=True,
        )
        parts, finish = [], None
        for chunk in chunks:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    with ThreadPoolExecutor(len(schemas)) as pool:  # concurrently: constrained rows share decode batches
        results = list(pool.map(stream, schemas))
    for schema, (text, finish) in zip(schemas, results):
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), schema)


def test_choice_and_rules_equal_the_reference(stack, reference, compiler) -> None:
    messages = [{"role": "user", "content": "Is water wet? Answer yes or no."}]
    reply = client(stack).chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, temperature=0, max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )
    assert reply.choices[0].message.content in {"yes", "no", "maybe"}
    assert reply.choices[0].finish_reason == "stop"

    rules = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "logit_bias": {"28": -100}}
    reply = client(stack).chat.completions.create(model=DEFAULT_MODEL, messages=messages, temperature=0,
                                                  max_tokens=24, **rules)  # type: ignore[arg-type]
    text, _ = reference_text(reference, compiler, messages, 24, sampling=SamplingConfig(
        presence_penalty=1.5, frequency_penalty=0.5, logit_bias=((28, -100.0),)))
    assert reply.choices[0].message.content == text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                                       "required": ["timezone"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_a_forced_tool_call_has_arguments_that_follow_its_schema(stack, choice) -> None:
    reply = client(stack).chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, CLOCK], tool_choice=choice, parallel_tool_calls=False, temperature=0, max_tokens=60,
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.tool_calls and len(message.tool_calls) == 1
    call = message.tool_calls[0].function
    if isinstance(choice, dict):
        assert call.name == "get_time"
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.name]
    jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])
