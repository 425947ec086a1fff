"""Prefill batching (``PrefillBatcher``): queued prompts' chunks share forwards, and what a user
gets — each prompt's first-token logits and the KV blocks exported for decode and the kvstore —
is bit for bit what computing the prompts one at a time gives, on both model families, for
prompts of mixed lengths with and without prefix-cache hits."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import torch
from prometheus_client import REGISTRY

from crescent.services.common.metrics import engine_metrics
from crescent.services.engine.engine import Engine, Sequence
from crescent.services.instance.runtime import EngineWorker
from crescent.services.prefill.batcher import PrefillBatcher, plan_step
from tests.engine import test_engine, test_kimi_k3

PAGE = 16
CHUNK = 2 * PAGE  # engine.prefill_chunk_tokens: long prompts take several chunks, alone or batched
FAMILIES = {"llama": test_engine, "kimi_k3": test_kimi_k3}
T = TypeVar("T")


def on_engine_thread(scenario: Callable[[EngineWorker], Awaitable[T]]) -> T:
    """Run ``scenario`` (given the engine thread's worker, as a prefill process has one) to its end."""
    worker = EngineWorker("prefill")
    thread = threading.Thread(target=worker.serve_forever)
    thread.start()
    try:
        return asyncio.run(scenario(worker))
    finally:
        worker.shutdown()
        thread.join()


# ---- the plan of one step ----------------------------------------------------------------------

def seq(num_tokens: int, computed: int = 0) -> Sequence:
    s = Sequence(f"s{num_tokens}-{computed}", list(range(num_tokens)), [])
    s.num_computed = computed
    s.pages = list(range(-(-computed // PAGE)))
    return s


def test_a_step_takes_each_prompt_s_next_chunk_oldest_first_within_the_budget() -> None:
    a, b, c, d = seq(100), seq(50, computed=32), seq(20), seq(10)
    # a: its first chunk (32); b: 32..50 (18); c: 20 would pass 64; d: 10 fits in what is left.
    step = plan_step([a, b, c, d], CHUNK, max_batch_tokens=64, free_pages=100, block_size=PAGE)
    assert [(s.seq_id, end) for s, end in step] == [(a.seq_id, 32), (b.seq_id, 50), (d.seq_id, 10)]


def test_the_oldest_prompt_always_runs_even_past_the_budget() -> None:
    a, b = seq(100), seq(5)
    step = plan_step([a, b], CHUNK, max_batch_tokens=8, free_pages=100, block_size=PAGE)
    assert [(s.seq_id, end) for s, end in step] == [(a.seq_id, 32)]


def test_a_moved_requests_decode_tail_is_never_cut_into_and_goes_in_one_step() -> None:
    moved = seq(100)
    moved.decode_tail = 45  # the last 45 tokens were decode's: a row each, all in one step
    ends = []
    while moved.num_computed < moved.num_tokens:
        ((_, end),) = plan_step([moved], CHUNK, max_batch_tokens=1000, free_pages=100, block_size=PAGE)
        ends.append(end)
        moved.num_computed, moved.pages = end, list(range(-(-end // PAGE)))
    assert ends == [32, 55, 100]


def test_chunks_whose_pages_are_not_there_wait_and_an_oldest_that_cannot_fit_runs_alone() -> None:
    a, b, c = seq(40), seq(40), seq(60, computed=50)  # c's chunk 50..60 stays in its last page
    step = plan_step([a, b, c], CHUNK, max_batch_tokens=1000, free_pages=2, block_size=PAGE)
    assert [s.seq_id for s, _ in step] == [a.seq_id, c.seq_id]  # a takes both free pages
    step = plan_step([a, c], CHUNK, max_batch_tokens=1000, free_pages=1, block_size=PAGE)
    assert [s.seq_id for s, _ in step] == [a.seq_id]  # it fails alone (CacheFullError), not with c


# ---- batched = one at a time, bit for bit ----------------------------------------------------------

BASE = 5 * PAGE + 3  # computed first: the prefix the hits below reuse


def workload(module) -> tuple[list[int], list[list[int]]]:
    """The base prompt and the queued prompts: mixed lengths, two of them extending the base."""
    base = module.prompt(BASE, seed=1)
    return base, [
        base[: 4 * PAGE] + module.prompt(29, seed=2),   # a prefix hit of 4 blocks, then 29 new tokens
        module.prompt(3 * CHUNK + 7, seed=3),            # cold, four chunks
        module.prompt(7, seed=4),                        # shorter than a block
        base[: 5 * PAGE] + module.prompt(40, seed=5),   # a hit of 5 blocks, then two chunks
        module.prompt(PAGE, seed=6),                     # exactly one block
    ]


def exported(engine: Engine, s: Sequence) -> list[torch.Tensor]:
    """Every block of the prompt as prefill exports it (the last one possibly partial)."""
    return [engine.block_payload(s, i, min(PAGE, s.num_tokens - i * PAGE)).clone()
            for i in range(-(-s.num_tokens // PAGE))]


def one_at_a_time(module, base: list[int], prompts: list[list[int]]):
    engine = module.make_engine(chunk=CHUNK)
    engine.prefill(engine.add_sequence("base", base))
    out = []
    for i, tokens in enumerate(prompts):
        s = engine.add_sequence(f"p{i}", tokens)
        logits = engine.prefill(s)
        out.append((s.num_cached, logits, exported(engine, s)))
    return out


def prefill_steps() -> tuple[float, float]:
    """(forwards, prompts in them) observed so far by prefill's prompts-per-forward histogram."""
    count = REGISTRY.get_sample_value("crescent_engine_batch_size_count", {"role": "prefill"}) or 0.0
    total = REGISTRY.get_sample_value("crescent_engine_batch_size_sum", {"role": "prefill"}) or 0.0
    return count, total


def batched(module, base: list[int], prompts: list[list[int]], max_batch_tokens: int):
    engine = module.make_engine(chunk=CHUNK)
    engine.prefill(engine.add_sequence("base", base))
    seqs = [engine.add_sequence(f"p{i}", tokens) for i, tokens in enumerate(prompts)]

    async def scenario(worker: EngineWorker) -> list[torch.Tensor]:
        batcher = PrefillBatcher(engine, worker, max_batch_tokens, engine_metrics("prefill"))
        try:
            return await asyncio.gather(*(batcher.prefill(s) for s in seqs))
        finally:
            await batcher.close()

    logits = on_engine_thread(scenario)
    return [(s.num_cached, row, exported(engine, s)) for s, row in zip(seqs, logits)]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_prefill_equals_one_prompt_at_a_time_bit_for_bit(family: str) -> None:
    module = FAMILIES[family]
    base, prompts = workload(module)
    expected = one_at_a_time(module, base, prompts)
    assert expected[0][0] > 0 and expected[3][0] > expected[0][0], "the hits are hits"
    serial_forwards = sum(-(-(len(p) - cached) // CHUNK) for p, (cached, _, _) in zip(prompts, expected))

    before = prefill_steps()
    got = batched(module, base, prompts, max_batch_tokens=3 * CHUNK)
    forwards, prompts_in_them = (a - b for a, b in zip(prefill_steps(), before))
    assert forwards < serial_forwards and prompts_in_them > forwards, "several prompts per forward"

    for i, ((cached, logits, blocks), (want_cached, want_logits, want_blocks)) in enumerate(zip(got, expected)):
        assert cached == want_cached, f"prompt {i}: cached tokens"
        assert torch.equal(logits, want_logits), f"prompt {i}: first-token logits"
        assert len(blocks) == len(want_blocks)
        assert all(torch.equal(a, b) for a, b in zip(blocks, want_blocks)), f"prompt {i}: exported KV"


def test_a_prompt_whose_caller_left_gets_no_further_chunk_and_the_others_complete() -> None:
    engine = test_engine.make_engine(chunk=CHUNK)
    long_prompt, other = test_engine.prompt(6 * CHUNK, seed=7), test_engine.prompt(50, seed=8)
    expected = test_engine.make_engine(chunk=CHUNK)
    want = expected.prefill(expected.add_sequence("o", other, use_cache=False))
    left, stays = engine.add_sequence("left", long_prompt), engine.add_sequence("stays", other)

    async def scenario(worker: EngineWorker) -> torch.Tensor:
        batcher = PrefillBatcher(engine, worker, 4 * CHUNK, engine_metrics("prefill"))
        try:
            leaving = asyncio.create_task(batcher.prefill(left))
            staying = asyncio.create_task(batcher.prefill(stays))
            await asyncio.sleep(0)  # both queued; the first step is on its way
            leaving.cancel()
            logits = await staying
            assert batcher.queued == 0
            return logits
        finally:
            await batcher.close()

    logits = on_engine_thread(scenario)
    assert torch.equal(logits, want)
    assert left.num_computed <= CHUNK, "no chunk of the cancelled prompt after the step it was in"


def test_a_budget_of_zero_computes_one_prompt_at_a_time_in_arrival_order() -> None:
    a, b = seq(100), seq(5)
    assert [s.seq_id for s, _ in plan_step([a, b], CHUNK, max_batch_tokens=0, free_pages=100, block_size=PAGE)] == [a.seq_id]
    base, prompts = workload(test_engine)
    expected = one_at_a_time(test_engine, base, prompts)
    before = prefill_steps()
    got = batched(test_engine, base, prompts, max_batch_tokens=0)
    forwards, prompts_in_them = (a - b for a, b in zip(prefill_steps(), before))
    assert forwards == prompts_in_them, "one prompt per forward"
    assert all(torch.equal(g[1], e[1]) for g, e in zip(got, expected))


def test_a_failing_step_ends_its_prompts_with_the_error_and_the_next_prompts_still_run() -> None:
    engine = test_engine.make_engine(chunk=CHUNK)
    tokens = test_engine.prompt(40, seed=9)
    expected = test_engine.make_engine(chunk=CHUNK)
    want = expected.prefill(expected.add_sequence("e", tokens, use_cache=False))
    real_step = engine.mixed_step

    def broken_once(chunks, decoding):
        engine.mixed_step = real_step
        raise RuntimeError("kernel failed")

    async def scenario(worker: EngineWorker) -> torch.Tensor:
        batcher = PrefillBatcher(engine, worker, 4 * CHUNK, engine_metrics("prefill"))
        try:
            engine.mixed_step = broken_once
            with pytest.raises(RuntimeError, match="kernel failed"):
                await batcher.prefill(engine.add_sequence("a", test_engine.prompt(30, seed=10), use_cache=False))
            return await batcher.prefill(engine.add_sequence("b", tokens, use_cache=False))
        finally:
            await batcher.close()

    logits = on_engine_thread(scenario)
    assert torch.equal(logits, want)
