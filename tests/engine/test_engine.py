"""The engine against a dense reference, and the invariances disaggregation relies on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from crescent.services.engine.engine import Engine
from crescent.services.engine.llama import LlamaModel
from crescent.services.engine.kv_cache import CacheFullError
from crescent.services.engine.sampler import SamplingConfig
from tests.engine.tiny_model import TINY, dense_logits, tiny_model, tiny_weights

PAGE = 16


def make_engine(capacity_tokens: int = 64 * PAGE, chunk: int = 2048) -> Engine:
    torch.set_num_threads(1)
    return Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=capacity_tokens, block_size=PAGE, prefill_chunk_tokens=chunk)


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(2, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_prefill_and_decode_match_dense_reference():
    engine = make_engine()
    tokens = prompt(45)
    seq = engine.add_sequence("a", tokens[:40])
    last = engine.prefill(seq)
    reference = dense_logits(TINY, tiny_weights(), tokens)
    assert rel_err(last, reference[39]) < 1e-5
    for i in range(40, 45):  # decode the remaining tokens one by one through the pages
        seq.token_ids.append(tokens[i])
        assert rel_err(engine.decode_step([seq])[0], reference[i]) < 1e-5


def test_chunked_prefill_matches_one_pass():
    whole, chunked = make_engine(), make_engine(chunk=PAGE)
    tokens = prompt(70)
    a = whole.prefill(whole.add_sequence("a", tokens))
    b = chunked.prefill(chunked.add_sequence("a", tokens))
    assert rel_err(b, a) < 1e-5


def test_local_prefix_hit_attaches_full_blocks_and_gives_same_logits():
    engine = make_engine()
    shared = prompt(50)
    first = engine.add_sequence("a", shared + prompt(5, seed=2))
    engine.prefill(first)
    engine.release(first)
    second_tokens = shared + prompt(9, seed=3)
    second = engine.add_sequence("b", second_tokens)
    assert second.num_cached == 48  # three full blocks of the 50 shared tokens
    warm = engine.prefill(second)
    cold_engine = make_engine()
    cold = cold_engine.prefill(cold_engine.add_sequence("c", second_tokens, use_cache=False))
    assert rel_err(warm, cold) < 1e-5


def test_whole_prompt_cached_still_computes_the_last_token():
    engine = make_engine()
    tokens = prompt(3 * PAGE)
    seq = engine.add_sequence("a", tokens)
    engine.prefill(seq)
    engine.release(seq)
    again = engine.add_sequence("b", tokens)
    assert again.num_cached == 2 * PAGE  # the last block is recomputed for its logits
    assert rel_err(engine.prefill(again), dense_logits(TINY, tiny_weights(), tokens)[-1]) < 1e-5


def test_salt_isolates_prefix_cache():
    engine = make_engine()
    tokens = prompt(40)
    seq = engine.add_sequence("a", tokens, salt=b"tenant-a")
    engine.prefill(seq)
    engine.release(seq)
    assert engine.add_sequence("b", tokens, salt=b"tenant-b").num_cached == 0
    assert engine.add_sequence("c", tokens, salt=b"tenant-a").num_cached == 32


def test_batched_decode_is_bitwise_equal_to_single_decode():
    tokens = [prompt(20 + 7 * i, seed=i) for i in range(6)]
    singles = []
    for t in tokens:
        engine = make_engine()
        seq = engine.add_sequence("s", t)
        engine.prefill(seq)
        seq.token_ids.append(5)
        singles.append(engine.decode_step([seq])[0])
    engine = make_engine()
    seqs = [engine.add_sequence(f"s{i}", t) for i, t in enumerate(tokens)]
    for seq in seqs:
        engine.prefill(seq)
        seq.token_ids.append(5)
    batched = engine.decode_step(seqs)
    for i, single in enumerate(singles):
        assert torch.equal(batched[i], single), f"sequence {i} differs when batched"


def test_handoff_of_block_payloads_reproduces_generation():
    prefill_engine, decode_engine = make_engine(), make_engine()
    tokens = prompt(37)
    expected = make_engine().generate(tokens, max_tokens=8, stop_token_ids=[])
    seq = prefill_engine.add_sequence("a", tokens)
    first = int(torch.argmax(prefill_engine.prefill(seq)))
    blocks = -(-len(tokens) // PAGE)
    payloads = [
        prefill_engine.block_payload(seq, i, min(PAGE, len(tokens) - i * PAGE)).clone() for i in range(blocks)
    ]
    adopted = decode_engine.adopt_sequence("a", tokens + [first], len(tokens), payloads)
    out = [first]
    while len(out) < 8:
        out.append(int(torch.argmax(decode_engine.decode_step([adopted])[0])))
        adopted.token_ids.append(out[-1])
    assert out == expected


def test_eviction_reuses_least_recently_used_cached_pages():
    engine = make_engine(capacity_tokens=4 * PAGE)
    a, b = prompt(2 * PAGE + 1, seed=10), prompt(2 * PAGE + 1, seed=11)
    for name, t in (("a", a), ("b", b)):
        seq = engine.add_sequence(name, t)
        engine.prefill(seq)
        engine.release(seq)
    # 'a' was used first: a new prompt needing pages evicts a's blocks, keeps b's.
    seq = engine.add_sequence("c", prompt(2 * PAGE, seed=12))
    engine.prefill(seq)
    engine.release(seq)
    assert engine.add_sequence("b2", b).num_cached == 2 * PAGE
    assert engine.add_sequence("a2", a).num_cached == 0


def test_seeded_sampling_is_reproducible_and_varies_with_seed():
    engine = make_engine()
    tokens = prompt(12)
    hot = SamplingConfig(temperature=1.5, top_p=0.95, top_k=40, seed=7)
    first = engine.generate(tokens, max_tokens=12, sampling=hot, stop_token_ids=[])
    assert engine.generate(tokens, max_tokens=12, sampling=hot, stop_token_ids=[]) == first
    other = engine.generate(tokens, max_tokens=12, sampling=SamplingConfig(temperature=1.5, top_p=0.95, top_k=40, seed=8), stop_token_ids=[])
    assert other != first


def test_a_reservation_keeps_its_pages_while_others_fill_the_cache():
    prefill_engine, engine = make_engine(), make_engine(capacity_tokens=8 * PAGE)
    tokens = prompt(2 * PAGE)
    seq = prefill_engine.add_sequence("a", tokens)
    first = int(torch.argmax(prefill_engine.prefill(seq)))
    payloads = [prefill_engine.block_payload(seq, i).clone() for i in range(2)]
    adopted = engine.adopt_sequence("a", tokens + [first], len(tokens), payloads, reserve_tokens=6 * PAGE)
    assert engine.cache.pages.unpromised_pages == 2
    with pytest.raises(CacheFullError):
        engine.adopt_sequence("b", tokens + [first], len(tokens), payloads, reserve_tokens=3 * PAGE)
    other = engine.cache.pages.allocate(2)  # someone takes every page nobody was promised
    while adopted.num_tokens < 6 * PAGE:  # growing into its reservation never meets a full cache
        adopted.token_ids.append(int(torch.argmax(engine.decode_step([adopted])[0])))
    assert adopted.num_tokens == 6 * PAGE and len(adopted.pages) == 6
    engine.release(adopted)
    engine.cache.pages.release(other)
    assert engine.cache.pages.free_pages == 8 and engine.cache.pages.promised_pages == 0


# A model the C++ decode op serves (head_dim 64), beside TINY's PyTorch path.
WIDE = dataclasses.replace(TINY, vocab_size=300, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                           head_dim=64)


@pytest.mark.parametrize("cfg", [TINY, WIDE], ids=["pytorch-decode", "cpp-decode"])
def test_a_moved_requests_recompute_gives_decodes_logits_bit_for_bit(cfg) -> None:
    """After a decode dies, the gateway places the request again with the prompt plus the tokens
    streamed; prefill computes those as decode's steps did, so the next token's logits are the
    very ones decode would have given, and a seeded draw continues the same."""
    torch.set_num_threads(1)
    model = LlamaModel(cfg, tiny_weights(cfg, seed=3))

    def engine(chunk: int) -> Engine:
        return Engine(model, model_id="m", kv_capacity_tokens=64 * PAGE, block_size=PAGE, prefill_chunk_tokens=chunk)

    tokens = torch.randint(2, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    first = engine(2048)
    seq = first.add_sequence("a", tokens)
    logits, generated, after = first.prefill(seq), [], []
    for _ in range(12):  # decode, one token a step, as a decode instance does
        generated.append(int(logits.argmax()))
        seq.token_ids.append(generated[-1])
        logits = first.decode_step([seq])[0]
        after.append(logits)
    for moved, chunk in ((5, 2048), (12, 64)):  # another instance, other chunking
        again = engine(chunk)
        recompute = again.add_sequence("b", tokens + generated[:moved], decode_tail=moved)
        assert torch.equal(again.prefill(recompute), after[moved - 1])
        other = engine(chunk)  # the same tokens as one prompt: close, but not decode's bits
        assert (other.prefill(other.add_sequence("c", tokens + generated[:moved])) - after[moved - 1]).abs().max() < 1e-4
