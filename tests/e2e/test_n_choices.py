"""``n > 1`` through real processes: n generations of one prompt, prefilled once.

Choice 0 samples with the request's seed, so it equals an ``n = 1`` request with that seed; the
later choices start once choice 0 has its first token and find the prompt's full blocks in the
prefix cache, which the prefill instances' ``crescent_engine_cached_tokens`` counter shows.
"""

from __future__ import annotations

import uuid

import openai
import pytest
from crescent.services.model.model_source import DEFAULT_MODEL

pytestmark = pytest.mark.slow

BLOCK = 64  # the stack's KV block size


def engine_cached_tokens(stack) -> float:
    """Prompt tokens the prefill instances reused from any cache, so far."""
    return sum(stack.metric(s["name"], "crescent_engine_cached_tokens_total")
               for s in stack.services if s["name"].startswith("prefill"))


def test_n_choices_share_the_prompt_and_choice_0_equals_n_1(stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    # A prompt no earlier test sent (so choice 0 finds nothing cached), with a few full blocks.
    context = f"Session {uuid.uuid4().hex}. " + "The shop opens at nine and closes at six on weekdays. " * 12
    messages = [{"role": "system", "content": context}, {"role": "user", "content": "Write a short poem."}]
    sampling = {"temperature": 0.8, "seed": 1234, "max_tokens": 12}
    before = engine_cached_tokens(stack)
    reply = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, n=3, **sampling)
    reused = engine_cached_tokens(stack) - before
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in reply.choices)
    full_blocks = (reply.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert full_blocks >= 2 * BLOCK
    assert reply.usage.prompt_tokens_details.cached_tokens == 0, "choice 0 prefilled the prompt itself"
    assert reused >= 2 * full_blocks, "the later choices did not find the prompt's blocks in the cache"
    assert reply.usage.completion_tokens <= 3 * 12
    assert len({c.message.content for c in reply.choices}) > 1, "three seeds, one text: the seeds did not reach prefill"

    single = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, **sampling)
    assert single.choices[0].message.content == reply.choices[0].message.content
