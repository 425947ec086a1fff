"""Hybrid-model memory that scales: one live KDA state per running sequence, sparse state
snapshots in a bounded LRU pool, bf16 latents and conv tails — and the cache's bytes against
docs/k3.md's formula, for the tiny test model (allocated) and the full K3 shape (on paper)."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import pytest
import torch

from crescent.services.engine.engine import Engine
from crescent.services.engine.kimi_k3 import K3_FULL, k3_footprint
from crescent.services.engine.kimi_k3.cache import K3Cache
from crescent.services.engine.kimi_k3.loading import seeded_weights
from crescent.services.engine.kimi_k3.model import K3Model
from crescent.services.engine.kimi_k3.snapshots import KdaStates, SnapshotPolicy
from crescent.services.instance.wire import block_matches, block_tensor, kv_dtype, payload_bytes
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import BlockFormatError, KvBlock
from tests.engine.k3_reference import TEST_CFG, dense_k3_logits

PAGE = 16
BF16_CFG = dataclasses.replace(TEST_CFG, cache_dtype="bfloat16")
DOC = Path(__file__).resolve().parents[2] / "docs" / "k3.md"


@functools.cache
def _weights() -> dict[str, torch.Tensor]:
    return seeded_weights(TEST_CFG, 0)


def make_engine(every: int = 1, slots: int = 32, cfg=TEST_CFG, pages: int = 64, chunk: int = 2048) -> Engine:
    torch.set_num_threads(1)
    model = K3Model(cfg, _weights(), snapshots=SnapshotPolicy(every_blocks=every, slots=slots))
    return Engine(model, model_id="k3-test", kv_capacity_tokens=pages * PAGE, block_size=PAGE,
                  prefill_chunk_tokens=chunk)


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(2, TEST_CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def cold(tokens: list[int], cfg=TEST_CFG) -> torch.Tensor:
    engine = make_engine(cfg=cfg)
    return engine.prefill(engine.add_sequence("cold", tokens, use_cache=False))


def run(engine: Engine, tokens: list[int], seq_id: str = "s") -> tuple[int, torch.Tensor]:
    """Prefill ``tokens`` as a new request; (tokens taken from the cache, last logits)."""
    seq = engine.add_sequence(seq_id, tokens)
    logits = engine.prefill(seq)
    engine.release(seq)
    return seq.num_cached, logits


# ---- sparse snapshots: where a hit resumes -----------------------------------------------------


def test_every_kth_block_a_hit_resumes_at_the_last_snapshot_below_the_match():
    engine = make_engine(every=4)
    base = prompt(10 * PAGE + 5)
    run(engine, base)  # snapshots after blocks 4 and 8 (every 4th) and 10 (the prompt's last full block)
    assert len(engine.cache.snapshots) == 3
    for shared, resumed in ((7 * PAGE + 3, 4), (9 * PAGE, 8), (10 * PAGE + 5, 10), (3 * PAGE, 0)):
        tokens = base[:shared] + prompt(20, seed=shared)
        cached, logits = run(engine, tokens, f"s{shared}")
        assert cached == resumed * PAGE, f"{shared} shared tokens"
        assert rel_err(logits, cold(tokens)) < 1e-6


def test_turn_ends_only_resume_the_next_turn_of_a_conversation():
    engine = make_engine(every=0)
    turn1 = prompt(5 * PAGE + 9)
    run(engine, turn1)
    assert len(engine.cache.snapshots) == 1  # the end of the prompt's last full block
    turn2 = turn1 + prompt(2 * PAGE, seed=7)  # the reply and the next user message follow
    cached, logits = run(engine, turn2)
    assert cached == 5 * PAGE
    assert rel_err(logits, cold(turn2)) < 1e-6
    assert run(engine, turn1[: 4 * PAGE] + prompt(9, seed=8))[0] == 0  # mid-prompt: nothing to resume from


def test_the_snapshot_pool_is_bounded_and_evicts_the_least_recently_used():
    engine = make_engine(every=1, slots=3)
    a, b = prompt(4 * PAGE + 2, seed=11), prompt(4 * PAGE + 2, seed=12)
    run(engine, a)
    assert len(engine.cache.snapshots) == 3  # blocks 2-4 of a: the pool holds 3
    assert run(engine, a[: 2 * PAGE + 3] + [7])[0] == 2 * PAGE
    run(engine, b)  # takes the pool over
    assert len(engine.cache.snapshots) == 3 and engine.cache.snapshots.evicted >= 3
    tokens = a + [5, 6]
    cached, logits = run(engine, tokens)  # a's latents are still cached, its snapshots are not
    assert cached == 0
    assert rel_err(logits, cold(tokens)) < 1e-6


def test_a_running_sequence_holds_exactly_one_state():
    engine = make_engine()
    seqs = [engine.add_sequence(f"s{i}", prompt(40 + i, seed=i)) for i in range(3)]
    assert engine.cache.running_states == 3
    for seq in seqs:
        engine.prefill(seq)
        seq.token_ids.append(3)
    engine.decode_step(seqs)
    assert engine.cache.running_states == 3
    for seq in seqs:
        engine.release(seq)
    assert engine.cache.running_states == 0


# ---- bf16 latents and conv tails ---------------------------------------------------------------


def test_bf16_cache_keeps_hits_chunking_and_decode_exact():
    engine = make_engine(every=2, cfg=BF16_CFG)
    assert engine.cache.latent.dtype == torch.bfloat16
    assert engine.cache.snapshots.states.tail.dtype == torch.bfloat16
    assert engine.cache.snapshots.states.state.dtype == torch.float32
    base = prompt(6 * PAGE + 4)
    run(engine, base)
    tokens = base[: 5 * PAGE + 1] + prompt(11, seed=3)
    cached, warm = run(engine, tokens)
    assert cached == 4 * PAGE
    reference = cold(tokens, BF16_CFG)
    assert rel_err(warm, reference) < 1e-6  # resumed = cold: both round at the same block boundaries
    chunked = make_engine(cfg=BF16_CFG, chunk=PAGE)
    assert rel_err(chunked.prefill(chunked.add_sequence("c", tokens)), reference) < 1e-6
    # against the fp32 textbook model, bf16 latents cost a little accuracy, no more
    assert rel_err(reference, dense_k3_logits(TEST_CFG, _weights(), tokens)[-1]) < 2e-2


@pytest.mark.parametrize(("chunk", "tolerance"), [(PAGE, 0.0), (7, 5e-4)])
def test_bf16_cache_rounds_at_block_boundaries_only_however_a_prompt_is_cut(chunk: int, tolerance: float):
    """A running sequence's conv tail stays fp32 between block boundaries, so prompt chunks of any
    length (the batcher's, not multiples of the block) round nothing a single pass does not.
    Block-sized chunks give the very same bits. Mid-block chunks cut the KDA segments
    differently (7e-6 apart in fp32), which moves a few stored values across a bf16 rounding tie:
    measured 8e-5. Tails stored in bf16 after every forward would move the logits by 0.28."""
    tokens = prompt(3 * PAGE + 5)
    reference = cold(tokens, BF16_CFG)
    engine = make_engine(cfg=BF16_CFG)
    seq = engine.add_sequence("c", tokens, use_cache=False)
    assert engine.cache.live(seq.state).tail.dtype == torch.float32
    logits = None
    for end in range(chunk, len(tokens) + chunk, chunk):
        logits = engine.mixed_step([(seq, min(end, len(tokens)))], [])[0][0]
    assert logits is not None and rel_err(logits, reference) <= tolerance


def test_handoff_carries_the_live_state_in_the_last_block_only():
    tokens = prompt(3 * PAGE + 5)
    expected = make_engine(cfg=BF16_CFG).generate(tokens, max_tokens=8, stop_token_ids=[])
    source, target = make_engine(every=0, cfg=BF16_CFG), make_engine(cfg=BF16_CFG)
    seq = source.add_sequence("a", tokens)
    first = int(torch.argmax(source.prefill(seq)))
    payloads = [source.block_payload(seq, i, min(PAGE, len(tokens) - i * PAGE)) for i in range(4)]
    # blocks 0-1: latents only; block 2: latents + its prompt-end snapshot; block 3 (partial): + the live state
    assert [p.dim() for p in payloads] == [2, 2, 1, 1]
    assert payloads[0].shape == source.cache.block_shape
    adopted = target.adopt_sequence("a", tokens + [first], len(tokens), [p.clone() for p in payloads])
    out = [first]
    while len(out) < 8:
        out.append(int(torch.argmax(target.decode_step([adopted])[0])))
        adopted.token_ids.append(out[-1])
    assert out == expected
    assert len(target.cache.snapshots) == 0  # decode keeps no snapshots


def _through_the_wire(engine: Engine, payload: torch.Tensor, index: int, tokens: list[int] = ()) -> KvBlock:
    """A payload as it travels (kvstore, peers, handoff): raw bytes under the cache's dtype."""
    key = BlockKey(bytes([index]) * 32)
    return KvBlock.build(key, None, "k3-test", kv_dtype(engine.cache), tuple(payload.shape), tokens,
                         payload_bytes(payload))


def test_bf16_blocks_travel_in_bf16_with_the_state_in_fp32():
    """Latents cross the wire in the cache dtype (half the fp32 bytes); a state travels as its fp32
    bytes in front of them, so a handed-off live tail arrives unrounded: decode continues exactly."""
    tokens = prompt(3 * PAGE + 5)
    expected = make_engine(cfg=BF16_CFG).generate(tokens, max_tokens=6, stop_token_ids=[])
    source, target = make_engine(every=0, cfg=BF16_CFG), make_engine(cfg=BF16_CFG)
    seq = source.add_sequence("a", tokens)
    first = int(torch.argmax(source.prefill(seq)))
    blocks = [_through_the_wire(source, source.block_payload(seq, i, min(PAGE, len(tokens) - i * PAGE)), i)
              for i in range(4)]
    latent_bytes = len(BF16_CFG.mla_layers) * BF16_CFG.mla_latent_dim * 2  # per token, bf16
    state_bytes = KdaStates.wire_floats(BF16_CFG) * 4                     # fp32, tails included
    assert all(b.dtype == "bfloat16" for b in blocks)
    assert [b.nbytes for b in blocks] == [PAGE * latent_bytes] * 2 + [state_bytes + PAGE * latent_bytes,
                                                                      state_bytes + 5 * latent_bytes]
    for b in blocks:
        b.verify("k3-test")
    adopted = target.adopt_sequence("a", tokens + [first], len(tokens), [block_tensor(b, b.shape) for b in blocks])
    assert torch.equal(target.cache.live(adopted.state).tail, source.cache.live(seq.state).tail)  # fp32, unrounded
    out = [first]
    while len(out) < 6:
        out.append(int(torch.argmax(target.decode_step([adopted])[0])))
        adopted.token_ids.append(out[-1])
    assert out == expected


def test_a_block_of_another_dtype_does_not_match():
    bf16, fp32 = make_engine(cfg=BF16_CFG), make_engine()
    tokens = prompt(PAGE + 3)
    seq = bf16.add_sequence("a", tokens)
    bf16.prefill(seq)
    block = _through_the_wire(bf16, bf16.block_payload(seq, 0), 0, tokens[:PAGE])
    assert block_matches(block, block.key, tokens[:PAGE], bf16.cache)
    assert not block_matches(block, block.key, tokens[:PAGE], fp32.cache)  # an fp32 engine recomputes
    with pytest.raises(ValueError, match="dtype"):
        fp32.cache.write_block(0, block_tensor(block, block.shape))
    odd = dataclasses.replace(block, dtype="int8")
    with pytest.raises(BlockFormatError, match="'int8'"):  # a dtype no cache holds: a malformed handoff
        block_tensor(odd, odd.shape)


def test_fetched_blocks_attach_up_to_the_last_one_with_a_state():
    source, target = make_engine(every=3), make_engine(every=3)
    tokens = prompt(8 * PAGE + 3)
    seq = source.add_sequence("a", tokens)
    source.prefill(seq)
    blocks = [source.block_payload(seq, i).clone() for i in range(8)]
    assert [b.dim() == 1 for b in blocks] == [False, False, True, False, False, True, False, True]
    other = target.add_sequence("b", tokens[: 7 * PAGE] + prompt(9, seed=5))
    assert target.attach_blocks(other, blocks[:7]) == 6 * PAGE  # block 7 has no state: recomputed
    assert rel_err(target.prefill(other), cold(other.token_ids)) < 1e-6


def test_fork_gets_its_own_copy_of_the_state():
    engine = make_engine()
    tokens = prompt(2 * PAGE)  # ends on a block boundary: the forks continue from a full page
    parent = engine.add_sequence("p", tokens)
    engine.prefill(parent)
    child = engine.fork_sequence(parent, "c", 9, reserve_tokens=3 * PAGE)
    parent.token_ids.append(9)
    both = engine.decode_step([parent, child])
    assert torch.equal(both[0], both[1])
    parent.token_ids.append(4)
    child.token_ids.append(4)
    both = engine.decode_step([parent, child])
    assert torch.equal(both[0], both[1])
    assert rel_err(both[0], dense_k3_logits(TEST_CFG, _weights(), tokens + [9, 4])[-1]) < 5e-4


# ---- bytes: the engine against docs/k3.md --------------------------------------------------------


def doc_formula() -> str:
    """The cache formula as docs/k3.md writes it (one line in a code block)."""
    found = re.search(r"^\s*cache bytes = (.+)$", DOC.read_text(), re.MULTILINE)
    assert found, "docs/k3.md states the cache formula"
    return found.group(1).strip()


def doc_cache_bytes(cfg, pages: int, block_size: int, sequences: int, snapshots: int) -> int:
    """Evaluate the docs' formula with the config's shape (names as the docs define them)."""
    latent_bytes = 2 if cfg.cache_dtype == "bfloat16" else 4
    names = {
        "pages": pages, "block_size": block_size, "sequences": sequences, "snapshots": snapshots,
        "mla_layers": len(cfg.mla_layers), "kda_layers": len(cfg.kda_layers),
        "kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "kda_v_heads": cfg.kda_num_v_heads, "K": cfg.kda_head_dim, "V": cfg.kda_v_head_dim,
        "conv_dim": cfg.kda_conv_dim, "W": cfg.kda_conv_width, "dtype_bytes": latent_bytes,
    }
    return eval(doc_formula().replace("×", "*").replace("−", "-"), {}, names)  # noqa: S307 (our own doc)


@pytest.mark.parametrize("cfg", [TEST_CFG, BF16_CFG], ids=["fp32", "bf16"])
def test_allocated_bytes_equal_the_documented_formula(cfg):
    engine = make_engine(slots=5, cfg=cfg, pages=12)
    seqs = [engine.add_sequence(f"s{i}", prompt(20, seed=i)) for i in range(2)]
    cache = engine.cache
    assert cache.live_pool.rows == len(seqs)  # the live states' pool: one row per running sequence at the peak
    tensors = [cache.latent, cache.snapshots.states.state, cache.snapshots.states.tail,
               cache.live_pool.state, cache.live_pool.tail]
    allocated = sum(t.untyped_storage().nbytes() for t in tensors)
    assert allocated == cache.nbytes() == doc_cache_bytes(cfg, 12, PAGE, 2, 5)
    assert allocated == k3_footprint(cfg).cache_bytes(12 * PAGE, 2, 5)


def test_full_k3_at_1m_tokens_is_latents_plus_the_snapshot_budget():
    """The engine's own layout for the full K3 shape, built on the meta device (nothing allocated)."""
    tokens, page, slots = 1 << 20, 64, 32
    cache = K3Cache(K3_FULL, tokens // page, page, device="meta", policy=SnapshotPolicy(every_blocks=16, slots=slots))
    cache.open_state()  # one running 1M-token sequence
    assert cache.nbytes() == doc_cache_bytes(K3_FULL, tokens // page, page, 1, slots)
    state = 69 * (96 * 128 * 128 * 4 + 3 * 96 * 128 * 3 * 2)  # 449,372,160 B: fp32 states, bf16 tails
    assert state == 449_372_160
    on_paper = 27_648 * tokens + slots * state  # "27.6 KB per token plus the bounded snapshot budget"
    assert abs(cache.nbytes() - on_paper) / on_paper < 0.05
    assert cache.page_bytes() == 64 * 27_648


def test_a_handoff_whose_last_block_has_no_state_is_refused():
    engine = make_engine()
    latents_only = [torch.zeros(engine.cache.payload_shape(n, with_state=False)) for n in (PAGE, 5)]
    with pytest.raises(ValueError, match="must carry one"):
        engine.adopt_sequence("x", prompt(22), 21, latents_only)
    assert engine.cache.running_states == 0 and engine.cache.pages.free_pages == 64  # nothing held
