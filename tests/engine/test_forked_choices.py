"""``n > 1`` in the engine: choices forked from one prefilled prompt share its full KV pages and
each generates exactly what an independent run with its seed generates, on both model families."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from crescent.services.contract.choices import choice_seed
from crescent.services.engine.engine import Engine
from crescent.services.engine.sampler import SamplingConfig, sample_batch
from tests.engine import test_engine, test_kimi_k3

PAGE = 16
N = 3
MAX_TOKENS = 8
FAMILIES = {"llama": test_engine, "kimi_k3": test_kimi_k3}


def choice_configs(seed: int) -> list[SamplingConfig]:
    base = SamplingConfig(temperature=0.9, seed=seed)
    return [replace(base, seed=choice_seed(seed, i)) for i in range(N)]


def forked_generation(engine: Engine, tokens: list[int], cfgs: list[SamplingConfig]) -> tuple[list[list[int]], list]:
    """Prefill once, sample each choice's first token from the same logits, fork, decode in one batch."""
    seq = engine.add_sequence("p", tokens, use_cache=False)
    logits = engine.prefill(seq)[None].repeat(N, 1)
    firsts = sample_batch(logits, cfgs, [0] * N, [tokens] * N)
    seq.token_ids.append(firsts[0])
    seqs = [seq] + [engine.fork_sequence(seq, f"p/{i}", firsts[i], reserve_tokens=len(tokens) + MAX_TOKENS)
                    for i in range(1, N)]
    outs = [[t] for t in firsts]
    while len(outs[0]) < MAX_TOKENS:
        tokens_now = sample_batch(engine.decode_step(seqs), cfgs, [len(o) for o in outs], [s.token_ids for s in seqs])
        for s, out, token in zip(seqs, outs, tokens_now):
            out.append(token)
            s.token_ids.append(token)
    return outs, seqs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompt_len", [37, 32])  # a partial last block, and none
def test_forked_choices_equal_independent_runs_and_share_full_pages(family: str, prompt_len: int) -> None:
    module = FAMILIES[family]
    tokens = module.prompt(prompt_len)
    cfgs = choice_configs(seed=11)
    expected = [module.make_engine().generate(tokens, MAX_TOKENS, cfg, stop_token_ids=[]) for cfg in cfgs]
    assert len({tuple(e) for e in expected}) > 1, "the seeds should give different choices"

    engine = module.make_engine()
    free_before = engine.cache.pages.free_pages
    outs, seqs = forked_generation(engine, tokens, cfgs)
    assert outs == expected

    full = prompt_len // PAGE
    assert all(s.pages[:full] == seqs[0].pages[:full] for s in seqs), "full prompt pages are shared"
    own = [set(s.pages[full:]) for s in seqs]
    assert all(not (a & b) for i, a in enumerate(own) for b in own[i + 1:]), "each choice writes only its own pages"
    used = free_before - engine.cache.pages.free_pages
    per_choice = -(-(prompt_len + MAX_TOKENS - 1) // PAGE) - full
    assert used == full + N * per_choice < N * (full + per_choice)
    for s in seqs:
        engine.release(s)
    assert engine.cache.pages.free_pages == free_before and engine.cache.pages.promised_pages == 0


def test_a_fork_without_room_holds_nothing() -> None:
    engine = test_engine.make_engine(capacity_tokens=4 * PAGE)
    tokens = test_engine.prompt(37)  # 3 pages, the last partial
    seq = engine.add_sequence("p", tokens, use_cache=False)
    engine.prefill(seq)
    seq.token_ids.append(5)
    free = engine.cache.pages.free_pages
    with pytest.raises(Exception, match="reserve"):
        engine.fork_sequence(seq, "p/1", 6, reserve_tokens=len(tokens) + 40)  # needs 3 pages of its own
    assert engine.cache.pages.free_pages == free and engine.cache.pages.promised_pages == 0
    child = engine.fork_sequence(seq, "p/1", 6, reserve_tokens=len(tokens) + 1)  # its partial copy only
    assert child.pages[:2] == seq.pages[:2] and child.pages[2] != seq.pages[2]
    assert torch.equal(engine.cache.read_block(child.pages[2], 5), engine.cache.read_block(seq.pages[2], 5))
