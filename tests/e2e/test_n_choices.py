"""``n > 1`` through real processes: the prompt is prefilled once and handed off once, and decode
runs the n choices on its shared KV.

Choice i samples with ``choice_seed(seed, i)`` (choice 0 with the seed itself), so each choice
equals an ``n = 1`` request with that seed: the shared KV changes nothing a client can see.
"""

from __future__ import annotations

import uuid

import openai
import pytest
from crescent.services.contract.choices import choice_seed
from crescent.services.model.model_source import DEFAULT_MODEL

pytestmark = pytest.mark.slow

BLOCK = 64  # the stack's KV block size


def role_total(stack, role: str, metric: str, labels: dict[str, str] | None = None) -> float:
    return sum(stack.metric(s["name"], metric, labels) for s in stack.services if s["name"].startswith(role))


def test_n_choices_prefill_once_share_the_kv_and_each_equals_its_n_1_run(stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    # A prompt no earlier test sent (nothing cached), with a few full blocks and a partial one.
    context = f"Session {uuid.uuid4().hex}. " + "The shop opens at nine and closes at six on weekdays. " * 12
    messages = [{"role": "system", "content": context}, {"role": "user", "content": "Write a short poem."}]
    seed = 1234
    sampling = {"temperature": 0.8, "max_tokens": 12}
    handoff = {"direction": "handoff_in"}

    computed_before = role_total(stack, "prefill", "crescent_engine_computed_tokens_total")
    handoff_before = role_total(stack, "decode", "crescent_engine_kv_transfer_bytes_total", handoff)
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, n=3, seed=seed, **sampling)
    computed = role_total(stack, "prefill", "crescent_engine_computed_tokens_total") - computed_before
    handed = role_total(stack, "decode", "crescent_engine_kv_transfer_bytes_total", handoff) - handoff_before

    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in reply.choices)
    prompt_tokens = reply.usage.prompt_tokens
    assert prompt_tokens >= 2 * BLOCK + 1 and prompt_tokens % BLOCK, "full blocks and a partial one"
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    assert computed == prompt_tokens, "the prompt was computed once for the three choices"
    assert reply.usage.completion_tokens <= 3 * 12
    assert len({c.message.content for c in reply.choices}) > 1, "three seeds, one text: the seeds did not reach prefill"

    handoff_before = role_total(stack, "decode", "crescent_engine_kv_transfer_bytes_total", handoff)
    for i, choice in enumerate(reply.choices):
        single = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages,
                                                seed=choice_seed(seed, i), **sampling)
        assert single.choices[0].message.content == choice.message.content, f"choice {i}"
        assert single.choices[0].finish_reason == choice.finish_reason
    one_handoff = (role_total(stack, "decode", "crescent_engine_kv_transfer_bytes_total", handoff)
                   - handoff_before) / 3
    assert handed == one_handoff > 0, "the prompt's KV crossed to decode once for the three choices"


def test_streamed_n_choices_interleave_and_each_finishes(stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": f"Name three colours. ({uuid.uuid4().hex})"}]
    texts = {i: "" for i in range(3)}
    finishes = {}
    with client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, n=3, seed=7, temperature=0.8,
                                        max_tokens=10, stream=True) as stream:
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    finishes[c.index] = c.finish_reason
    assert set(finishes) == {0, 1, 2} and all(t for t in texts.values())
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, n=3, seed=7, temperature=0.8,
                                           max_tokens=10)
    assert [c.message.content for c in reply.choices] == [texts[i] for i in range(3)]


def test_completions_with_several_prompts_place_each_prompt_s_choices_together(stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [f"Once upon a time ({uuid.uuid4().hex[:8]})", f"The recipe begins ({uuid.uuid4().hex[:8]})"]
    sampling = {"temperature": 0.8, "max_tokens": 8, "seed": 42}
    reply = client.completions.create(model=DEFAULT_MODEL, prompt=prompts, n=2, **sampling)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]  # prompt p's choice i is p * n + i
    for c in reply.choices:
        p, i = divmod(c.index, 2)
        single = client.completions.create(model=DEFAULT_MODEL, prompt=prompts[p],
                                           **{**sampling, "seed": choice_seed(42, i)})
        assert single.choices[0].text == c.text, f"prompt {p}, choice {i}"
