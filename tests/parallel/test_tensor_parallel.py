"""A tensor-parallel group of two real processes on loopback computing the tiny model.

What a user would notice: the group generates the tokens a single process does, with logits
within float rounding (the all-reduce sums partial products in another order); its KV blocks
read back as the single-process blocks (so handoff, kvstore and peers cannot tell); a block
written into it reads back the same; settings that cannot run are refused with the numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from crescent.services.engine.engine import Engine
from crescent.services.engine.parallel.leader import TensorParallelLlama
from crescent.services.engine.parallel.settings import GroupSettingsError, ParallelSettings
from crescent.services.engine.parallel.shard import shard_shape
from crescent.services.prefill.layerwise import hands_off_layerwise
from tests.engine.tiny_model import TINY, tiny_model
from tests.parallel.support import start_tiny_worker, tiny_leader
from tests.ports import free_port

PAGE = 4
PROMPTS = [[5, 9, 13, 2, 7, 7, 30, 41, 3, 8, 11], [60, 61, 62, 63, 64, 65, 66], [3], [12, 24, 36, 48, 60, 72, 84, 96, 8]]
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TensorParallelLlama]:
    torch.set_num_threads(1)
    port = free_port()
    log = tmp_path_factory.mktemp("tp") / "worker.log"
    worker = start_tiny_worker(port, 1, 2, TIMEOUT_S, log)
    try:
        model = tiny_leader(port, 2, TIMEOUT_S)
    except BaseException:
        worker.kill()
        raise
    yield model
    model.group.close()
    try:
        assert worker.wait(10) == 0, log.read_text()  # told to shut down, the worker exits cleanly
    finally:
        if worker.poll() is None:
            worker.kill()


def engines(model: TensorParallelLlama) -> tuple[Engine, Engine]:
    settings = dict(model_id="tiny", kv_capacity_tokens=64 * PAGE, block_size=PAGE, min_cached_prompt_tokens=0)
    return Engine(model, **settings), Engine(tiny_model(), **settings)


@pytest.mark.slow
def test_greedy_tokens_and_logits_match_a_single_process(group: TensorParallelLlama) -> None:
    tp, one = engines(group)
    for prompt in PROMPTS:
        assert tp.generate(prompt, 12, stop_token_ids=[]) == one.generate(prompt, 12, stop_token_ids=[])
    # A decode batch of several sequences, after their prompts, step by step.
    seqs = {e: [e.add_sequence(f"s{i}", p) for i, p in enumerate(PROMPTS)] for e in (tp, one)}
    firsts = {e: torch.stack([e.prefill(s) for s in seqs[e]]) for e in (tp, one)}
    torch.testing.assert_close(firsts[tp], firsts[one], atol=1e-4, rtol=0)
    logits = firsts
    for _ in range(5):
        for e in (tp, one):
            for seq, row in zip(seqs[e], logits[tp]):  # both follow the group's tokens
                seq.token_ids.append(int(torch.argmax(row)))
        logits = {e: e.decode_step(seqs[e]) for e in (tp, one)}
        torch.testing.assert_close(logits[tp], logits[one], atol=1e-4, rtol=0)
        assert torch.equal(logits[tp].argmax(-1), logits[one].argmax(-1))
    for e in (tp, one):
        for seq in seqs[e]:
            e.release(seq)


@pytest.mark.slow
def test_a_prefix_hit_reuses_the_groups_pages(group: TensorParallelLlama) -> None:
    tp, one = engines(group)
    base = PROMPTS[0]
    for e in (tp, one):
        seq = e.add_sequence("first", base)
        e.prefill(seq)
        e.release(seq)  # its full blocks stay cached
    longer = [*base, 17, 19, 23]
    hits = {e: e.add_sequence("again", longer) for e in (tp, one)}
    assert hits[tp].num_cached == hits[one].num_cached == 2 * PAGE
    torch.testing.assert_close(tp.prefill(hits[tp]), one.prefill(hits[one]), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_blocks_read_as_single_process_blocks_and_writes_read_back(group: TensorParallelLlama) -> None:
    tp, one = engines(group)
    assert tp.cache.block_shape == one.cache.block_shape and tp.cache.wire_dtype == one.cache.wire_dtype
    # Decode assembles a layer-wise handoff by this layout, as in one process; prefill sends whole blocks.
    assert tp.cache.layer_layout() == one.cache.layer_layout()
    assert not hands_off_layerwise(tp) and hands_off_layerwise(one)
    prompt = PROMPTS[0]  # 2 full pages and a partial one
    seqs = {e: e.add_sequence("b", prompt) for e in (tp, one)}
    for e, seq in seqs.items():
        e.prefill(seq)
    for index in range(3):
        tokens = min(PAGE, len(prompt) - index * PAGE)
        got = tp.block_payload(seqs[tp], index, tokens)
        want = one.block_payload(seqs[one], index, tokens)
        assert got.shape == want.shape == tp.cache.payload_shape(tokens)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # A block handed in (a handoff, a kvstore hit) lands on both ranks and reads back unchanged.
    (page,) = tp.cache.pages.allocate(1)
    for tokens in (PAGE, 3):
        payload = torch.randn(tp.cache.payload_shape(tokens))
        tp.cache.write_block(page, payload)
        assert torch.equal(tp.cache.read_block(page, tokens), payload)
    tp.cache.pages.release([page])
    # ... and a handed-off sequence decodes as in one process.
    payloads = [one.block_payload(seqs[one], i, min(PAGE, len(prompt) - i * PAGE)) for i in range(3)]
    first = int(torch.argmax(one.prefill(one.add_sequence("x", prompt))))
    adopted = {e: e.adopt_sequence("h", [*prompt, first], len(prompt), payloads, reserve_tokens=32) for e in (tp, one)}
    torch.testing.assert_close(tp.decode_step([adopted[tp]]), one.decode_step([adopted[one]]), atol=1e-4, rtol=0)


def test_group_settings_that_cannot_run_are_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"num_kv_heads \(2\) divisible by 3"):
        shard_shape(TINY, 0, 3)
    odd_mlp = TINY.__class__(**{**{f: getattr(TINY, f) for f in TINY.__dataclass_fields__}, "intermediate_size": 66,
                                "num_kv_heads": 4})
    with pytest.raises(ValueError, match=r"intermediate_size \(66\) divisible by 4"):
        shard_shape(odd_mlp, 0, 4)
    with pytest.raises(GroupSettingsError, match=r"rank 2 is outside a group of 2 processes"):
        ParallelSettings(group_size=2, rank=2).resolve({})
    with pytest.raises(GroupSettingsError, match=r"LWS_WORKER_INDEX must be an integer"):
        ParallelSettings().resolve({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "one"})
    lws = ParallelSettings().resolve({"LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "3", "LWS_LEADER_ADDRESS": "lead.ns"})
    assert (lws.size, lws.rank, lws.leader_address, lws.is_leader) == (4, 3, "lead.ns", False)
    assert ParallelSettings().resolve({}).size == 1  # outside a LeaderWorkerSet: one process, as before
    with pytest.raises(GroupSettingsError, match=r"backend nccl .* use gloo"):
        ParallelSettings(group_size=2, backend="nccl").resolve({})
