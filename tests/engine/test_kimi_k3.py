"""The kimi_k3 model family in the engine: exactness of state-aware prefix caching, batching,
hand-off and kvstore round trips, loading, memory accounting."""

from __future__ import annotations

import functools

import pytest
import torch

from crescent.services.kvwire.chunk_wire import chunks_of_block, decode_chunk, encode_chunk
from crescent.services.kvwire.kv_block import BlockAssembler, KvBlock
from crescent.services.engine.engine import Engine
from crescent.services.engine.kimi_k3.loading import seeded_weights
from crescent.services.engine.kimi_k3.model import K3Model
from crescent.services.engine.kimi_k3.snapshots import SnapshotPolicy
from tests.engine.k3_reference import TEST_CFG, dense_k3_logits

PAGE = 16


@functools.cache
def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    return seeded_weights(TEST_CFG, seed)


# A snapshot at every block (the engine's default keeps every 16th): the tests built on this
# engine (here, tests/prefill's) take prefix hits that end at any block.
DENSE_SNAPSHOTS = SnapshotPolicy(every_blocks=1, slots=32)


def make_engine(capacity_tokens: int = 64 * PAGE, chunk: int = 2048) -> Engine:
    torch.set_num_threads(1)
    return Engine(K3Model(TEST_CFG, _weights(), snapshots=DENSE_SNAPSHOTS), model_id="k3-test",
                  kv_capacity_tokens=capacity_tokens, block_size=PAGE, prefill_chunk_tokens=chunk)


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(2, TEST_CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def cold_logits(tokens: list[int]) -> torch.Tensor:
    engine = make_engine()
    return engine.prefill(engine.add_sequence("cold", tokens, use_cache=False))


def test_prefill_and_decode_match_a_dense_reference():
    engine = make_engine()
    tokens = prompt(45)
    reference = dense_k3_logits(TEST_CFG, _weights(), tokens)
    seq = engine.add_sequence("a", tokens[:37])  # two full blocks and a partial one
    assert rel_err(engine.prefill(seq), reference[36]) < 5e-4
    for i in range(37, 45):  # decode the rest token by token through the pages
        seq.token_ids.append(tokens[i])
        assert rel_err(engine.decode_step([seq])[0], reference[i]) < 5e-4


def test_decode_crosses_block_boundaries_exactly():
    engine = make_engine()
    tokens = prompt(3 * PAGE + 3)
    reference = dense_k3_logits(TEST_CFG, _weights(), tokens)
    seq = engine.add_sequence("a", tokens[: PAGE - 2])
    engine.prefill(seq)
    for i in range(PAGE - 2, len(tokens)):
        seq.token_ids.append(tokens[i])
        assert rel_err(engine.decode_step([seq])[0], reference[i]) < 5e-4, f"position {i}"


@pytest.mark.parametrize("shared", [50, 3 * PAGE, 40])
def test_prefix_hit_resumes_at_a_block_boundary_with_the_same_logits(shared: int):
    engine = make_engine()
    first = engine.add_sequence("a", prompt(shared) + prompt(5, seed=2))
    engine.prefill(first)
    engine.release(first)
    tokens = prompt(shared) + prompt(9, seed=3)
    second = engine.add_sequence("b", tokens)
    # only full blocks of the shared prefix are reused; the partial one is recomputed
    assert second.num_cached == (shared // PAGE) * PAGE
    assert second.num_cached % PAGE == 0
    warm = engine.prefill(second)
    assert rel_err(warm, cold_logits(tokens)) < 1e-6


def test_whole_prompt_cached_recomputes_the_last_block():
    engine = make_engine()
    tokens = prompt(3 * PAGE)
    seq = engine.add_sequence("a", tokens)
    engine.prefill(seq)
    engine.release(seq)
    again = engine.add_sequence("b", tokens)
    assert again.num_cached == 2 * PAGE
    assert rel_err(engine.prefill(again), dense_k3_logits(TEST_CFG, _weights(), tokens)[-1]) < 5e-4


def test_a_shorter_first_prompt_never_lends_its_partial_block():
    engine = make_engine()
    short = prompt(PAGE + 7)
    seq = engine.add_sequence("a", short)
    engine.prefill(seq)
    engine.release(seq)
    longer = short + prompt(20, seed=4)
    seq = engine.add_sequence("b", longer)
    assert seq.num_cached == PAGE
    assert rel_err(engine.prefill(seq), cold_logits(longer)) < 1e-6


def test_chunked_prefill_matches_one_pass():
    whole, chunked = make_engine(), make_engine(chunk=PAGE)
    tokens = prompt(70)
    a = whole.prefill(whole.add_sequence("a", tokens))
    b = chunked.prefill(chunked.add_sequence("a", tokens))
    assert rel_err(b, a) < 1e-6


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


def test_blocks_round_trip_through_kvstore_bytes():
    """Prefill A exports its full blocks as kvstore blocks; engine B attaches them from bytes."""
    a, b = make_engine(), make_engine()
    tokens = prompt(4 * PAGE + 5)
    seq = a.add_sequence("a", tokens)
    a.prefill(seq)
    blocks = []
    for i, key in enumerate(seq.block_keys):
        payload = a.block_payload(seq, i)  # latents, and the state snapshot where the block keeps one
        sent = KvBlock.build(key, seq.block_keys[i - 1] if i else None, "k3-test", "float32", tuple(payload.shape),
                             tokens[i * PAGE : (i + 1) * PAGE], payload.numpy().tobytes())
        assembler = BlockAssembler()  # the kvstore's wire form: serialised chunks
        chunks = [decode_chunk(encode_chunk(c)) for c in chunks_of_block(sent, 4096)]
        received = [assembler.feed(c) for c in chunks][-1]
        received.verify("k3-test")
        blocks.append(torch.frombuffer(bytearray(received.payload), dtype=torch.float32).view(received.shape))
    assert len(blocks) == 4
    other = b.add_sequence("b", tokens)
    assert b.missing_prefix_keys(other) == seq.block_keys[:4]
    assert b.attach_blocks(other, blocks) == 4 * PAGE
    assert rel_err(b.prefill(other), cold_logits(tokens)) < 1e-6


def test_handoff_of_block_payloads_reproduces_generation():
    prefill_engine, decode_engine = make_engine(), make_engine()
    tokens = prompt(37)
    expected = make_engine().generate(tokens, max_tokens=10, stop_token_ids=[])
    seq = prefill_engine.add_sequence("a", tokens)
    first = int(torch.argmax(prefill_engine.prefill(seq)))
    payloads = []
    for i in range(-(-len(tokens) // PAGE)):
        payload = prefill_engine.block_payload(seq, i, min(PAGE, len(tokens) - i * PAGE))
        blob = payload.numpy().tobytes()  # as bytes travel; the block's shape says whether it carries a state
        payloads.append(torch.frombuffer(bytearray(blob), dtype=torch.float32).reshape(payload.shape))
    assert sum(decode_engine.cache.payload_tokens(p.shape) for p in payloads) == len(tokens)
    adopted = decode_engine.adopt_sequence("a", tokens + [first], len(tokens), payloads)
    out = [first]
    while len(out) < 10:
        out.append(int(torch.argmax(decode_engine.decode_step([adopted])[0])))
        adopted.token_ids.append(out[-1])
    assert out == expected


def test_malformed_payload_shape_is_rejected():
    cache = make_engine().cache
    with pytest.raises(ValueError):
        cache.payload_tokens((cache.block_shape[0] + 1,))
    with pytest.raises(ValueError):
        cache.payload_tokens((2, 3))
