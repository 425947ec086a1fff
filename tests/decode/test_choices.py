"""``n > 1`` in decode, with a real (tiny) engine and no network: one handoff, n choices on the
prompt's shared KV, each equal to a single-process run with its seed; one choice aborted alone
gives back its own pages while the others finish."""

from __future__ import annotations

import asyncio

from crescent.services.decode.admission import KvLedger
from crescent.services.engine.sampler import SamplingConfig
from tests.decode.support import PAGE, handed_off, prompt, read_choices, running_batcher, tiny_engine

N = 3
SAMPLING = SamplingConfig(temperature=0.9, seed=5)


def reference(tokens: list[int], max_tokens: int, sampling: SamplingConfig) -> list[int]:
    return tiny_engine(64 * PAGE).generate(tokens, max_tokens, sampling, stop_token_ids=[])


def test_n_choices_share_the_prompt_and_each_equals_its_single_run() -> None:
    prefill, decode = tiny_engine(64 * PAGE), tiny_engine(64 * PAGE)
    tokens, max_tokens = prompt(37, seed=3), 12

    async def scenario():
        async with running_batcher(decode) as batcher:
            request = handed_off(prefill, "n3", tokens, max_tokens, SAMPLING, n=N)
            batcher.accept(request)
            promised = decode.cache.capacity_tokens - batcher.free_kv_tokens
            results = await read_choices(request)
            await asyncio.sleep(0.05)  # the last release runs on the engine thread
            return request, promised, results, batcher.free_kv_tokens

    request, promised, results, free_after = asyncio.run(scenario())
    ledger = KvLedger(decode.cache.pages.num_pages, PAGE)
    single = ledger.pages_for(len(tokens) + max_tokens)
    assert promised == ledger.pages_for_choices(len(tokens), len(tokens) + max_tokens, N) * PAGE
    assert promised < N * single * PAGE, "the prompt's full pages are reserved once"
    assert sorted(results) == list(range(N))
    outputs = []
    for choice in request.choices:
        out, reason = results[choice.index]
        assert reason == "length"
        outputs.append([choice.token_ids[-1], *out])
        assert outputs[-1] == reference(tokens, max_tokens, choice.sampling), choice.index
    assert len({tuple(o) for o in outputs}) > 1
    assert free_after == decode.cache.capacity_tokens
    assert decode.cache.pages.promised_pages == 0


def test_one_choice_aborted_alone_frees_its_pages_and_the_others_finish() -> None:
    prefill, decode = tiny_engine(64 * PAGE), tiny_engine(64 * PAGE)
    tokens, max_tokens = prompt(40, seed=4), 40

    async def scenario():
        async with running_batcher(decode) as batcher:
            request = handed_off(prefill, "ab", tokens, max_tokens, SAMPLING, n=N)
            batcher.accept(request)
            seen: dict[int, list[int]] = {i: [] for i in range(N)}
            while not seen[1]:
                update = await request.queue.get()
                seen[update.index] += update.token_ids
            free_before = batcher.free_kv_tokens
            assert batcher.abort_choice("ab", 1, "stop string")
            freed = batcher.free_kv_tokens - free_before
            rest = await read_choices(request)
            await asyncio.sleep(0.05)
            return request, freed, seen, rest, batcher.free_kv_tokens

    request, freed, seen, rest, free_after = asyncio.run(scenario())
    ledger = KvLedger(decode.cache.pages.num_pages, PAGE)
    assert freed == ledger.own_pages(len(tokens), len(tokens) + max_tokens) * PAGE
    assert 1 not in rest or not rest[1][0], "nothing more is sent for the aborted choice"
    for choice in request.choices:
        if choice.index == 1:
            continue
        out = seen[choice.index] + rest[choice.index][0]
        assert rest[choice.index][1] == "length"
        assert [choice.token_ids[-1], *out] == reference(tokens, max_tokens, choice.sampling)
    assert free_after == decode.cache.capacity_tokens
    assert decode.cache.pages.free_pages == decode.cache.pages.num_pages


def test_aborting_the_last_open_choice_ends_the_stream_and_frees_everything() -> None:
    prefill, decode = tiny_engine(64 * PAGE), tiny_engine(64 * PAGE)

    async def scenario():
        async with running_batcher(decode) as batcher:
            request = handed_off(prefill, "last", prompt(20, seed=6), 200, SAMPLING, n=2)
            batcher.accept(request)
            batcher.abort_choice("last", 0, "stop string")
            batcher.abort_choice("last", 1, "stop string")
            updates = []
            while not (updates and updates[-1].ends_request):
                updates.append(await request.queue.get())
            await asyncio.sleep(0.05)
            return updates, request.finished, batcher.free_kv_tokens

    updates, finished, free_after = asyncio.run(scenario())
    assert finished
    assert updates[-1].last and updates[-1].finish_reason is None and not updates[-1].token_ids
    assert all(u.finish_reason is None for u in updates), "an aborted choice sends no finish of its own"
    assert free_after == decode.cache.capacity_tokens
