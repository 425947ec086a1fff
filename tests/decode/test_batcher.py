"""Decode admission and batching with a real (tiny) engine, no network.

What a user would notice: every accepted request completes with the tokens a single-process
run gives, whatever the cache size, the batch cap or a broken neighbour in the batch.
"""

from __future__ import annotations

import asyncio

from crescent.services.decode.batcher import ERROR
from crescent.services.decode.admission import KvLedger
from crescent.services.engine.sampler import SamplingConfig
from tests.decode.support import PAGE, handed_off, prompt, read_all, running_batcher, tiny_engine


def reference(tokens: list[int], max_tokens: int, sampling: SamplingConfig = SamplingConfig()) -> list[int]:
    return tiny_engine(64 * PAGE).generate(tokens, max_tokens, sampling, stop_token_ids=[])


def test_more_requests_than_the_cache_holds_all_complete_with_single_process_tokens() -> None:
    prefill, decode = tiny_engine(64 * PAGE), tiny_engine(8 * PAGE)  # room for two requests at a time
    prompts = [prompt(20 + 3 * i, seed=i) for i in range(6)]
    max_tokens = 24

    async def scenario():
        async with running_batcher(decode) as batcher:
            requests = [handed_off(prefill, f"r{i}", t, max_tokens) for i, t in enumerate(prompts)]
            for request in requests:
                batcher.accept(request)
            waited = len(batcher.waiting)
            promised_all = batcher.free_kv_tokens
            results = await asyncio.gather(*(read_all(r) for r in requests))
            await asyncio.sleep(0.05)  # the last release runs on the engine thread
            return requests, results, waited, promised_all, batcher.free_kv_tokens

    requests, results, waited, promised_all, free_after = asyncio.run(scenario())
    assert waited >= 4, "what does not fit waits instead of being refused"
    assert promised_all == 0
    for request, tokens, (out, reason) in zip(requests, prompts, results):
        assert reason == "length", request.request_id
        assert [request.choices[0].token_ids[-1], *out] == reference(tokens, max_tokens), request.request_id
    assert free_after == decode.cache.capacity_tokens
    assert decode.cache.pages.free_pages == decode.cache.pages.num_pages
    assert decode.cache.pages.promised_pages == 0


def test_a_broken_sequence_ends_alone_and_its_batch_carries_on() -> None:
    prefill, decode = tiny_engine(64 * PAGE), tiny_engine(64 * PAGE)
    step = decode.decode_step

    def failing_step(seqs):
        if any(s.seq_id == "poison" for s in seqs):
            raise RuntimeError("bad sequence")
        return step(seqs)

    decode.decode_step = failing_step
    prompts = {f"ok{i}": prompt(18 + i, seed=10 + i) for i in range(3)}

    async def scenario():
        async with running_batcher(decode) as batcher:
            good = [handed_off(prefill, rid, t, 12) for rid, t in prompts.items()]
            bad = handed_off(prefill, "poison", prompt(25, seed=99), 12)
            for request in [good[0], bad, *good[1:]]:
                batcher.accept(request)
            return good, await asyncio.gather(*(read_all(r) for r in good)), await read_all(bad)

    good, results, (bad_tokens, bad_reason) = asyncio.run(scenario())
    assert bad_reason == ERROR and bad_tokens == []
    for request, (out, reason) in zip(good, results):
        assert reason == "length"
        assert [request.choices[0].token_ids[-1], *out] == reference(prompts[request.request_id], 12)


def test_the_batch_cap_bounds_each_step_not_what_is_accepted() -> None:
    prefill, decode = tiny_engine(64 * PAGE), tiny_engine(64 * PAGE)
    sizes: list[int] = []
    step = decode.decode_step
    decode.decode_step = lambda seqs: (sizes.append(len(seqs)), step(seqs))[1]
    prompts = [prompt(17, seed=20 + i) for i in range(5)]

    async def scenario():
        async with running_batcher(decode, max_batch_size=2) as batcher:
            requests = [handed_off(prefill, f"r{i}", t, 8) for i, t in enumerate(prompts)]
            for request in requests:
                batcher.accept(request)
            return requests, await asyncio.gather(*(read_all(r) for r in requests))

    requests, results = asyncio.run(scenario())
    assert max(sizes) == 2
    for request, tokens, (out, _) in zip(requests, prompts, results):
        assert [request.choices[0].token_ids[-1], *out] == reference(tokens, 8)


def test_aborts_give_back_promises_and_pages_at_once() -> None:
    prefill, decode = tiny_engine(64 * PAGE), tiny_engine(6 * PAGE)

    async def scenario():
        async with running_batcher(decode) as batcher:
            long = handed_off(prefill, "long", prompt(30, seed=1), 60)      # 6 pages: the whole cache
            queued = handed_off(prefill, "queued", prompt(20, seed=2), 10)  # waits behind it
            batcher.accept(long)
            batcher.accept(queued)
            await long.queue.get()  # running now
            assert [r.request_id for r in batcher.waiting] == ["queued"]
            assert batcher.abort("queued", "client gone")
            free_after_waiting_abort = batcher.free_kv_tokens
            assert batcher.abort("long", "client gone")
            assert not batcher.abort("long", "again"), "a second abort finds nothing"
            await asyncio.sleep(0.1)
            return free_after_waiting_abort, batcher.free_kv_tokens, batcher.drain_left()

    after_waiting, after_all, left = asyncio.run(scenario())
    assert after_waiting == 0  # the running request still holds every page
    assert after_all == decode.cache.capacity_tokens
    assert decode.cache.pages.free_pages == decode.cache.pages.num_pages
    assert sorted(left) == ["long", "queued"]


def test_a_migrated_seeded_request_continues_the_original_tokens() -> None:
    prefill, decode = tiny_engine(64 * PAGE), tiny_engine(64 * PAGE)
    hot = SamplingConfig(temperature=1.2, top_p=0.9, seed=11)
    tokens = prompt(21, seed=5)
    original = reference(tokens, 14, hot)
    done = 5  # the client had these when its decode instance died

    async def scenario():
        async with running_batcher(decode) as batcher:
            request = handed_off(prefill, "moved", tokens + original[:done], 14 - done, hot, first_step=done)
            batcher.accept(request)
            out, reason = await read_all(request)
            return [request.choices[0].token_ids[-1], *out], reason

    rest, reason = asyncio.run(scenario())
    assert reason == "length"
    assert original[:done] + rest == original


def test_ledger_promises_waiting_requests_too_and_admits_in_order() -> None:
    ledger = KvLedger(num_pages=10, block_size=PAGE)
    ledger.wait("a", ledger.pages_for(6 * PAGE))
    ledger.wait("b", ledger.pages_for(4 * PAGE + 1))  # 5 pages
    assert ledger.free_tokens == 0
    ledger.admit("a")
    assert not ledger.fits_now("b")
    ledger.release("a")
    assert ledger.fits_now("b")
    ledger.admit("b")
    assert ledger.free_tokens == 5 * PAGE
