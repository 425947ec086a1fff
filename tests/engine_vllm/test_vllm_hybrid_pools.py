"""A hybrid model (recurrent layers beside attention) on vLLM prefill and decode pools, as a user
meets it: the OpenAI API of a real gateway, scheduler and kvstore, one vLLM prefill and one vLLM
decode (``crescent up --engine vllm --aggregated 0``'s roles) serving the tiny Qwen3-Next of
tests/engine_vllm/tiny_hybrid.py. Prefill computes each prompt; its connector saves the attention
blocks and the recurrent-state snapshot vLLM keeps at the last block boundary before the prompt's
last token; decode loads both from the kvstore, computes the rest and streams. The reference is a
standalone vLLM (no connector) on the same checkpoint, run to completion before the stack starts,
so no more than two of this module's vLLM processes are ever alive at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.engine_vllm.tiny_hybrid import BLOCK, prompt_ids, run_driver
from tests.engine_vllm.vllm_stack import StackModel, VllmStack, cached, vllm_interpreter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(vllm_interpreter() is None, reason="make install-vllm first")]

MAX_TOKENS = 16
# Prompts of at most this many tokens go from prefill to decode under a one-time handoff salt
# (engine.min_cached_prompt_tokens, 256 by default: raised so that one such prompt is longer than
# a 256-token block and has something to load).
PRIVATE_UPTO = 400
# Decode computes each prompt's tail from the loaded snapshot. The tiny model's gated recurrence
# forgets within a few dozen tokens (a zeroed snapshot still gave the right 16 tokens after tails
# of 18-185), so two prompts end one token past a block: their first output token is computed
# straight from the snapshot, and a wrong one changes it.
PROMPTS = {  # name -> prompt; loadable blocks: (tokens - 1) // 256
    "short": prompt_ids(200, 1),     # no full block before its last token: decode computes it all
    "handoff": prompt_ids(257, 2),   # one-time salt: one block, the snapshot after it, a 1-token tail
    "tenant": prompt_ids(697, 3),    # the tenant's salt: two blocks and the snapshot after 512
    "tail": prompt_ids(513, 4),      # two blocks, the snapshot after 512, a 1-token tail
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid-pools")


@pytest.fixture(scope="module")
def reference(tiny_hybrid_checkpoint: Path, run_dir: Path) -> dict[str, str]:
    """Each prompt's greedy text from a standalone vLLM (no connector, no Crescent)."""
    jobs = [{"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True} for prompt in PROMPTS.values()]
    results = run_driver(tiny_hybrid_checkpoint, "", jobs, run_dir / "standalone-vllm.log")
    tokenizer = Tokenizer.from_file(str(tiny_hybrid_checkpoint / "tokenizer.json"))
    assert all(len(r["tokens"]) == MAX_TOKENS for r in results)
    return {name: tokenizer.decode(r["tokens"], skip_special_tokens=True) for name, r in zip(PROMPTS, results)}


@pytest.fixture(scope="module")
def stack(reference: dict[str, str], tiny_hybrid_checkpoint: Path, run_dir: Path) -> Iterator[VllmStack]:
    # ``reference`` first: its vLLM has exited before these two start.
    model = StackModel(str(tiny_hybrid_checkpoint), BLOCK, {"dtype": "bfloat16", "max_model_len": 2048},
                       {"min_cached_prompt_tokens": PRIVATE_UPTO})
    stack = VllmStack(run_dir / "stack", None, model)
    stack.run_dir.mkdir()
    try:
        stack.start({"prefill-0": "prefill", "decode-0": "decode"})
        yield stack
    finally:
        stack.stop()


def greedy(stack: VllmStack, prompt: list[int], tenant: str = "acme", **kwargs):  # noqa: ANN201
    return stack.client(tenant).completions.create(
        model=Path(stack.model.spec).name, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True}, **kwargs)


def test_greedy_outputs_equal_a_standalone_vllm_and_decode_resumes_from_the_kvstore(
        stack: VllmStack, reference: dict[str, str]) -> None:
    statuses = stack.instances()
    assert all(statuses[name].info.kv_format.startswith("vllm-hybrid-") for name in ("prefill-0", "decode-0"))
    for name, prompt in PROMPTS.items():
        before = stack.kvstore_hits()
        reply = greedy(stack, prompt)
        loaded = stack.kvstore_hits() - before
        assert reply.choices[0].text == reference[name], f"{name}: {len(prompt)} tokens"
        assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == MAX_TOKENS
        assert cached(reply) == 0
        blocks = (len(prompt) - 1) // BLOCK
        if blocks:
            assert loaded >= blocks + 1, f"{name}: decode loaded its {blocks} block(s) and the snapshot after them"
        else:
            assert loaded == 0, f"{name}: nothing before the last token fills a block"


def test_a_repeat_resumes_on_prefill_and_another_tenant_finds_nothing(
        stack: VllmStack, reference: dict[str, str]) -> None:
    prompt = PROMPTS["tenant"]
    greedy(stack, prompt)  # (the first test asked it too: this one does not depend on it)
    again = greedy(stack, prompt)
    assert cached(again) == (len(prompt) - 1) // BLOCK * BLOCK, "prefill resumes at its last snapshot"
    assert again.choices[0].text == reference["tenant"]
    theirs = greedy(stack, prompt, tenant="globex")
    assert cached(theirs) == 0, "never across tenants"
    assert theirs.choices[0].text == reference["tenant"]
    streamed = "".join(c.choices[0].text for c in greedy(stack, PROMPTS["tail"], stream=True) if c.choices)
    assert streamed == reference["tail"]
