"""Log-probabilities through real processes, against the same model's log_softmax in this process.

The whole stack (gateway → scheduler → prefill, which reports the first token's entry → decode,
which reports the rest) serves greedy requests with ``logprobs``; each reported entry must be
the single-process reference's ``log_softmax`` of that step's raw logits (within 1e-4), the
sampled token must be the most likely alternative, and a ``logit_bias`` that changes the pick
must not change the numbers (they are the model's, before any rule: docs/logprobs.md).
"""

from __future__ import annotations

import openai
import pytest
import torch
from crescent.services.model.model_source import DEFAULT_MODEL

pytestmark = pytest.mark.slow

TOP = 3


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def reference_steps(reference, token_ids: list[int], max_tokens: int,
                    bias: dict[int, float] | None = None) -> list[tuple[int, float, list[float]]]:
    """Greedy steps of the model alone: (token, its raw log-probability, the TOP largest ones),
    the pick made on the biased logits, the numbers taken from the raw ones; EOS ends it."""
    engine, tokenizer = reference
    eos = set(tokenizer.eos_token_ids)
    seq = engine.add_sequence("logprobs-reference", token_ids, use_cache=False)
    steps = []
    try:
        logits = engine.prefill(seq)
        for _ in range(max_tokens):
            raw = torch.log_softmax(logits.float(), dim=-1)
            picked = logits.float().clone()
            for token_id, value in (bias or {}).items():
                picked[token_id] += value
            token = int(torch.argmax(picked))
            steps.append((token, float(raw[token]), torch.topk(raw, TOP).values.tolist()))
            if token in eos:
                break
            seq.token_ids.append(token)
            logits = engine.decode_step([seq])[0]
    finally:
        engine.release(seq)
    return steps


def chat_ids(reference, messages) -> list[int]:
    _, tokenizer = reference
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


def assert_matches(entries, steps, tokenizer) -> None:
    """``entries`` (chat shape, as dicts) are the reference's steps, the end-of-turn token left out."""
    eos = set(tokenizer.eos_token_ids)
    expected = [s for s in steps if s[0] not in eos]
    assert len(entries) == len(expected)
    for entry, (token, logprob, top) in zip(entries, expected):
        raw = tokenizer.token_bytes(token)
        assert (entry["token"], entry["bytes"]) == (raw.decode("utf-8", errors="replace"), list(raw))
        assert entry["logprob"] == pytest.approx(logprob, abs=1e-4)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top, abs=1e-4)


def test_greedy_chat_logprobs_equal_the_reference(stack, reference) -> None:
    _, tokenizer = reference
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    reply = client(stack).chat.completions.create(model=DEFAULT_MODEL, messages=messages, temperature=0,
                                                  max_tokens=20, logprobs=True, top_logprobs=TOP)
    entries = [e.model_dump() for e in reply.choices[0].logprobs.content]
    steps = reference_steps(reference, chat_ids(reference, messages), 20)
    assert_matches(entries, steps, tokenizer)
    for entry in entries:  # greedy, no rules: the sampled token is the most likely one
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == reply.choices[0].message.content

    stream = client(stack).chat.completions.create(model=DEFAULT_MODEL, messages=messages, temperature=0,
                                                   max_tokens=20, logprobs=True, top_logprobs=TOP, stream=True)
    streamed = [e.model_dump() for chunk in stream for c in chunk.choices if c.logprobs is not None
                for e in c.logprobs.content]
    assert streamed == entries


def test_logit_bias_changes_the_pick_not_the_reported_numbers(stack, reference) -> None:
    _, tokenizer = reference
    messages = [{"role": "user", "content": "Is water wet? Answer yes or no."}]
    plain = reference_steps(reference, chat_ids(reference, messages), 1)
    bias = {plain[0][0]: -100.0}  # forbid the model's favourite first token
    reply = client(stack).chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, temperature=0, max_tokens=8, logprobs=True, top_logprobs=TOP,
        logit_bias={str(k): v for k, v in bias.items()})
    entries = [e.model_dump() for e in reply.choices[0].logprobs.content]
    assert_matches(entries, reference_steps(reference, chat_ids(reference, messages), 8, bias), tokenizer)
    first = entries[0]
    assert first["top_logprobs"][0]["token"] != first["token"], "the biased-away token is still the most likely"


def test_completions_token_logprobs_equal_the_reference(stack, reference) -> None:
    _, tokenizer = reference
    prompt = "The capital of France is"
    reply = client(stack).completions.create(model=DEFAULT_MODEL, prompt=prompt, temperature=0, max_tokens=8,
                                             logprobs=2)
    logprobs = reply.choices[0].logprobs
    steps = [s for s in reference_steps(reference, tokenizer.encode(prompt), 8) if s[0] not in tokenizer.eos_token_ids]
    assert logprobs.token_logprobs == pytest.approx([lp for _, lp, _ in steps], abs=1e-4)
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert all(len(top) <= 3 and token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs))
