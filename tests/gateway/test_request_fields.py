"""What SDKs and agent frameworks send that means nothing new: explicit nulls, ignored fields.

The OpenAI SDK sends ``null`` for a parameter passed as ``None``, and frameworks fill in
``store``, ``metadata``, ``service_tier``, ``user``, ``response_format: {"type": "text"}`` or
``tools`` with ``tool_choice: "none"``. Each is a 200 with the same reply as without it.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from .fake_tokenizer import MODEL_ID
from .support import FakeBackend, Gateway

USER = [{"role": "user", "content": "hi there"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
NULLABLE = ["n", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "logit_bias", "temperature",
            "top_p", "seed", "stop", "max_tokens", "max_completion_tokens", "response_format", "tools", "tool_choice",
            "parallel_tool_calls", "stream_options", "user", "store", "metadata", "service_tier", "prediction",
            "cache_salt", "top_k", "ignore_eos", "stream"]


def test_explicit_null_means_absent_for_every_optional_field(gateway: Gateway) -> None:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi there", "name": None}],
            **dict.fromkeys(NULLABLE)}
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "hi there"


def test_null_for_a_required_field_is_still_a_400(gateway: Gateway) -> None:
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": None, "messages": USER}, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"


def test_the_sdk_with_none_values(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=USER, n=None, presence_penalty=None, frequency_penalty=None,  # type: ignore[arg-type]
        logprobs=None, top_logprobs=None, logit_bias=None, response_format=None, seed=None,
    )
    assert reply.choices[0].message.content == "hi there"


@pytest.mark.parametrize("extra", [
    {"store": True}, {"metadata": {"team": "search"}}, {"service_tier": "auto"}, {"user": "user-42"},
    {"prediction": {"type": "content", "content": "hi there"}}, {"response_format": {"type": "text"}},
    {"parallel_tool_calls": True},
], ids=lambda extra: next(iter(extra)))
def test_fields_accepted_and_ignored(client: openai.OpenAI, model: str, extra: dict[str, Any]) -> None:
    reply = client.chat.completions.create(model=model, messages=USER, extra_body=extra)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == "hi there"


def test_tools_with_tool_choice_none_on_a_model_without_tool_support(
        client: openai.OpenAI, model: str, backend: FakeBackend) -> None:
    reply = client.chat.completions.create(model=model, messages=USER, tools=TOOLS, tool_choice="none")  # type: ignore[arg-type]
    assert reply.choices[0].message.content == "hi there"
    assert reply.choices[0].finish_reason == "stop"
    prompt = backend.get("/prefills")[-1]["token_ids"]
    from .fake_tokenizer import FakeTokenizer

    assert "lookup" not in FakeTokenizer().decode(prompt), "tools not offered were rendered into the prompt"


@pytest.mark.parametrize(("extra", "param"), [
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
])
def test_what_is_not_implemented_is_refused_by_name(client: openai.OpenAI, model: str, extra: dict[str, Any],
                                                    param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=USER, extra_body=extra)  # type: ignore[arg-type]
    assert caught.value.body["param"] == param  # type: ignore[index]
