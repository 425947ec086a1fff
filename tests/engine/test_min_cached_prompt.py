"""Kimi's API rule: a prompt of at most ``min_cached_prompt_tokens`` tokens leaves no cached blocks,
so whether such a (short, guessable) prompt was sent before never shows; longer prompts' blocks
still serve any later prompt, short ones included."""

from __future__ import annotations

import torch

from crescent.services.engine.engine import Engine
from crescent.services.engine.settings import EngineSettings
from tests.engine.tiny_model import TINY, tiny_model

PAGE = 16
LIMIT = 64


def make_engine(limit: int = LIMIT) -> Engine:
    torch.set_num_threads(1)
    return Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=64 * PAGE, block_size=PAGE,
                  min_cached_prompt_tokens=limit)


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(2, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, tokens: list[int], seq_id: str) -> int:
    """Prefill ``tokens``; returns how many of them came from the cache."""
    seq = engine.add_sequence(seq_id, tokens)
    engine.prefill(seq)
    engine.release(seq)
    return seq.num_cached


def test_a_prompt_at_the_limit_leaves_nothing_cached() -> None:
    engine = make_engine()
    short = prompt(LIMIT)
    assert run(engine, short, "a") == 0
    assert run(engine, short, "b") == 0, "a repeated short prompt must not hit"
    assert run(engine, short + prompt(40, seed=2), "c") == 0, "nor may a longer prompt that starts with it"


def test_a_moved_short_prompt_leaves_nothing_however_many_tokens_were_streamed() -> None:
    """After a decode died, a request comes back as its prompt plus the tokens it streamed
    (``decode_tail``); the rule still counts the client's prompt."""
    engine = make_engine()
    moved = prompt(LIMIT - 1) + prompt(3 * PAGE, seed=3)  # 63 of the client's, 48 streamed: past the limit
    for seq_id in ("a", "b"):
        seq = engine.add_sequence(seq_id, moved, decode_tail=3 * PAGE)
        engine.prefill(seq)
        engine.release(seq)
        assert seq.num_cached == 0, "nothing of a short prompt is cached, moved or not"
    assert run(engine, moved, "c") == 0


def test_a_longer_prompt_is_cached_and_serves_shorter_ones() -> None:
    engine = make_engine()
    long = prompt(LIMIT + 1)
    assert run(engine, long, "a") == 0
    assert run(engine, long, "b") == LIMIT  # four full blocks; the last token is always computed
    assert run(engine, long[:40], "c") == 32, "a short prompt may reuse blocks a long one left"


def test_zero_keeps_every_prompt_and_the_served_default_is_kimis_rule() -> None:
    engine = make_engine(limit=0)
    short = prompt(20)
    run(engine, short, "a")
    assert run(engine, short, "b") == PAGE
    assert EngineSettings().min_cached_prompt_tokens == 256
