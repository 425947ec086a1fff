"""``Engine.mixed_step``: chunks of several prompts and decoding sequences in one forward give
every row exactly what it gives alone (chunked prefill mixed into decode steps), on both model
families."""

from __future__ import annotations

import pytest
import torch

from crescent.services.engine.engine import Engine, Sequence
from tests.engine import test_engine, test_kimi_k3

PAGE = 16
FAMILIES = {"llama": test_engine, "kimi_k3": test_kimi_k3}
PROMPTS = (45, 30)   # prefilled in chunks of PAGE tokens (K3's delta rule needs block-aligned chunks)
DECODING = (20, 27)  # prefilled first, then decoding while the prompts above are prefilled
STEPS = 3


def started(engine: Engine, tokens: list[int], name: str) -> Sequence:
    """A sequence prefilled alone with its greedy first token appended, ready to decode."""
    seq = engine.add_sequence(name, tokens, use_cache=False)
    seq.token_ids.append(int(torch.argmax(engine.prefill(seq))))
    return seq


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_steps_equal_prefill_and_decode_alone(family: str) -> None:
    module = FAMILIES[family]
    prompts = [module.prompt(n, seed=10 + i) for i, n in enumerate(PROMPTS)]
    decoding = [module.prompt(n, seed=20 + i) for i, n in enumerate(DECODING)]

    # Alone: each prompt prefilled in chunks of PAGE, each decoding sequence stepped by itself.
    alone = module.make_engine(chunk=PAGE)
    expected_prompt_logits = [alone.prefill(alone.add_sequence(f"p{i}", p, use_cache=False))
                              for i, p in enumerate(prompts)]
    expected_decode = []
    for i, tokens in enumerate(decoding):
        seq = started(alone, tokens, f"d{i}")
        rows = []
        for _ in range(STEPS):
            logits = alone.decode_step([seq])[0]
            rows.append(logits)
            seq.token_ids.append(int(torch.argmax(logits)))
        expected_decode.append(rows)

    # Together: the same chunks and decode tokens in one forward per step.
    engine = module.make_engine(chunk=PAGE)
    dec = [started(engine, tokens, f"d{i}") for i, tokens in enumerate(decoding)]
    pre = [engine.add_sequence(f"p{i}", p, use_cache=False) for i, p in enumerate(prompts)]
    got_prompt_logits: list[torch.Tensor | None] = [None] * len(pre)
    for step in range(STEPS):
        chunks = [(s, min(s.num_computed + PAGE, s.num_tokens)) for s in pre if s.num_computed < s.num_tokens]
        prompt_logits, decode_logits = engine.mixed_step(chunks, dec)
        assert decode_logits.shape[0] == len(dec)
        for (seq, _), logits in zip(chunks, prompt_logits):
            if logits is not None:
                got_prompt_logits[pre.index(seq)] = logits
        for i, seq in enumerate(dec):
            assert torch.equal(decode_logits[i], expected_decode[i][step]), f"decode row {i}, step {step}"
            seq.token_ids.append(int(torch.argmax(decode_logits[i])))
    for i, logits in enumerate(got_prompt_logits):
        assert logits is not None, f"prompt {i} did not complete in {STEPS} steps"
        assert torch.equal(logits, expected_prompt_logits[i]), f"prompt {i}"
    # A completed prompt's full blocks are registered for the prefix cache, as after prefill().
    assert engine.cache.pages.cached_blocks >= sum(n // PAGE for n in PROMPTS)


def test_a_chunk_that_does_not_end_its_prompt_returns_no_logits() -> None:
    engine = test_engine.make_engine()
    seq = engine.add_sequence("p", test_engine.prompt(40), use_cache=False)
    prompt_logits, decode_logits = engine.mixed_step([(seq, 16)], [])
    assert prompt_logits == [None] and decode_logits.shape[0] == 0
    assert seq.num_computed == 16
    with pytest.raises(AssertionError):
        engine.mixed_step([(seq, 16)], [])  # nothing left to compute up to 16
