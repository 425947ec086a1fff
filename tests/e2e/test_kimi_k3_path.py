"""``crescent up --model kimi-k3-nano``: the hybrid model through the whole disaggregated path.

Replies must equal greedy generation in this process; a shared prefix must come back as whole
blocks (MLA latents + KDA state snapshots) from prefill's cache and, once evicted, from the
kvstore, with the same output as a cold run. Twice: with the preset's fp32 cache, and with
``engine.kv_cache_dtype: bfloat16`` on prefill and decode, whose blocks (kvstore puts and gets,
the handoff) travel in bf16 with their states in fp32.

Greedy decoding is what makes replies comparable, but K3's card fixes the temperature (1.0
thinking, 0.6 instant): the stack runs with an operator's card (``model_policy``) that keeps K3's
reasoning controls and drops its sampling locks. Replies are asked in instant mode (thinking
disabled), so the random model's text is the reply's ``content``; a forced tool call runs with
thinking on.
"""

from __future__ import annotations

import json
from typing import Literal

import openai
import pydantic
import pytest
import torch

from crescent.protos import common_pb2
from crescent.services.engine.constraints import ConstraintCompiler
from crescent.services.engine.engine import Engine
from crescent.services.engine.kimi_k3.loading import load_k3_model
from crescent.services.gateway.parsing.xtml_grammar import in_response_channel
from crescent.services.model.kimi_tokenizer import tokenizer_for
from crescent.services.model.model_source import resolve_model
from tests.e2e.stack import Stack, start_stack, stop_stack

pytestmark = pytest.mark.slow

MODEL = "kimi-k3-nano"
BLOCK = 16
KV_TOKENS = 1024
# K3's reasoning controls without its sampling locks (module docstring).
UNLOCKED_K3_CARD = {"reasoning_efforts": ["max", "low", "high"], "thinking": ["enabled", "disabled"],
                    "thinking_keep": ["all"]}
INSTANT = {"thinking": {"type": "disabled"}}
CONTEXT = ("The lighthouse keeper logs the tide, the wind and every passing ship in a blue notebook. " * 6)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cache_dtype(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def k3_stack(tmp_path_factory: pytest.TempPathFactory, cache_dtype: str) -> Stack:
    env = {f"CRESCENT_{role}__ENGINE__KV_CACHE_DTYPE": cache_dtype for role in ("PREFILL", "DECODE")}
    env["CRESCENT_GATEWAY__MODEL_POLICY"] = json.dumps(UNLOCKED_K3_CARD)
    env["CRESCENT_PREFILL__ENGINE__STATE_SNAPSHOT_EVERY_BLOCKS"] = "1"  # hits at any block (the default: every 16th)
    running = start_stack(tmp_path_factory.mktemp("k3-stack"), "--model", MODEL, "--block-size", str(BLOCK),
                          "--kv-capacity-tokens", str(KV_TOKENS), env=env)
    yield running
    stop_stack(running)


@pytest.fixture(scope="module")
def k3_reference(cache_dtype: str):
    torch.set_num_threads(2)
    source = resolve_model(MODEL)
    engine = Engine(load_k3_model(source, cache_dtype=cache_dtype), model_id=MODEL, kv_capacity_tokens=4096,
                    block_size=BLOCK)
    return engine, tokenizer_for(source)


def ask(stack: Stack, messages: list[dict], max_tokens: int):
    api = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    return api.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                       extra_body=INSTANT)


def prompt_ids(reference, messages: list[dict], **template_vars) -> list[int]:
    """The prompt the gateway builds for an instant-mode request (K3's format)."""
    tokenizer = reference[1]
    return tokenizer.encode(tokenizer.apply_chat_template(messages, thinking=False, **template_vars))


def reference_reply(reference, messages: list[dict], max_tokens: int) -> tuple[list[int], list[int]]:
    ids = prompt_ids(reference, messages)
    return ids, reference[0].generate(ids, max_tokens)


def reply_text(reference, out: list[int]) -> str:
    tokenizer = reference[1]
    return tokenizer.decode([t for t in out if t not in set(tokenizer.eos_token_ids)])


def test_reply_equals_single_process_generation(k3_stack, k3_reference):
    messages = [{"role": "user", "content": "Describe the sea in one line."}]
    reply = ask(k3_stack, messages, 12)
    ids, out = reference_reply(k3_reference, messages, 12)
    message = reply.choices[0].message
    assert message.content == reply_text(k3_reference, out)
    assert reply.usage.prompt_tokens == len(ids)


def test_shared_prefix_resumes_from_cached_blocks(k3_stack, k3_reference):
    first = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "Who keeps the log?"}]
    second = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "What colour is it?"}]
    ask(k3_stack, first, 2)
    reply = ask(k3_stack, second, 12)
    first_ids, _ = reference_reply(k3_reference, first, 1)
    second_ids, out = reference_reply(k3_reference, second, 12)
    common = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b)
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert cached == min(common, len(first_ids) - 1) // BLOCK * BLOCK  # whole blocks the first prompt computed
    assert cached >= 4 * BLOCK
    assert reply.choices[0].message.content == reply_text(k3_reference, out)


def test_prefix_evicted_from_prefill_comes_back_from_the_kvstore(k3_stack, k3_reference):
    context = CONTEXT.replace("lighthouse keeper", "ferry pilot")
    before = k3_stack.metric("prefill-0", "crescent_engine_cached_tokens_total", {"source": "kvstore"})
    ask(k3_stack, [{"role": "system", "content": context}, {"role": "user", "content": "Hi"}], 2)
    for name in ("buoy", "gull"):  # two prompts of 60% of the cache each: the second evicts the context
        flood = [{"role": "user", "content": ""}]
        for words in range(50, 2000, 10):
            flood[0]["content"] = " ".join(f"{name}{i}" for i in range(words))
            if len(prompt_ids(k3_reference, flood)) > 0.6 * KV_TOKENS:
                break
        ask(k3_stack, flood, 2)
        k3_stack.wait_heartbeats(("prefill-0", "decode-0"))  # a load report clears the scheduler's reservation for it
    messages = [{"role": "system", "content": context}, {"role": "user", "content": "Where does it sail?"}]
    reply = ask(k3_stack, messages, 12)
    _, out = reference_reply(k3_reference, messages, 12)
    from_kvstore = k3_stack.metric("prefill-0", "crescent_engine_cached_tokens_total", {"source": "kvstore"}) - before
    assert from_kvstore >= 4 * BLOCK and from_kvstore % BLOCK == 0
    assert reply.choices[0].message.content == reply_text(k3_reference, out)


class Verdict(pydantic.BaseModel):
    verdict: Literal["yes", "no", "unsure"]
    confidence: Literal["low", "medium", "high"]


def test_structured_output_and_forced_tool_call_on_the_kimi_family(k3_stack, k3_reference, cache_dtype: str):
    """The SDK's .parse() and a forced tool call, on Kimi's tokenizer and markup, equal the reference."""
    if cache_dtype != "float32":
        pytest.skip("constraints do not depend on the cache dtype: checked once, in fp32")
    api = openai.OpenAI(base_url=f"{k3_stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Is the tide high?"}]
    reply = api.chat.completions.parse(model=MODEL, messages=messages, response_format=Verdict, temperature=0,
                                       max_tokens=60, extra_body=INSTANT)
    assert isinstance(reply.choices[0].message.parsed, Verdict)
    schema = openai.lib._pydantic.to_strict_json_schema(Verdict)
    engine, tokenizer = k3_reference
    compiler = ConstraintCompiler.for_model(MODEL, engine.config.vocab_size, engine.config.eos_token_ids)
    # K3: the JSON is the response channel's text, then the channel and the message close.
    constraint = in_response_channel(common_pb2.Constraint(json_schema=json.dumps(schema)), thinking=False)
    prompt = prompt_ids(k3_reference, messages,
                        response_format={"type": "json_schema", "json_schema": {"name": "Verdict", "schema": schema}})
    expected = engine.generate(prompt, 60, constraint=compiler.compile(constraint))
    text = tokenizer.decode(expected)
    assert text.endswith("<|close|>response<|sep|><|close|>message<|sep|>")
    assert reply.choices[0].message.content == text.removesuffix("<|close|>response<|sep|><|close|>message<|sep|>")

    tide = {"type": "function", "function": {"name": "tide_table", "parameters": {
        "type": "object", "properties": {"port": {"enum": ["Brest", "Oslo"]}}, "required": ["port"],
        "additionalProperties": False}}}
    # K3's markup around a call takes ~50 tokens (channels closed, tools channel, json element): room for it.
    chunks = api.chat.completions.create(model=MODEL, messages=messages, tools=[tide], tool_choice="required",
                                         parallel_tool_calls=False, temperature=0, max_tokens=120, stream=True)
    names, arguments, finish = [], [], None
    for chunk in chunks:
        for call in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            names += [call.function.name] if call.function and call.function.name else []
            arguments.append(call.function.arguments or "" if call.function else "")
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert names == ["tide_table"] and finish == "tool_calls"
    assert json.loads("".join(arguments))["port"] in {"Brest", "Oslo"}
