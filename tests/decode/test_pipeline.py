"""The decode pipeline in-process (``services/decode/pipeline.py``), no network: a real prefill
pipeline hands its prompts to it through the wire codec, both on the tiny model.

What a user would notice: a handed-off prompt streams the tokens one process generates, handed
off a layer at a time or whole, and its KV goes back once read; what decode refuses (draining,
aborted before it came, a second handoff of an id, larger than the whole cache) is refused
before any of its KV is read, and what is malformed or unusable here admits nothing; a reader
that leaves early, or an Abort, ends the request and frees its KV; an id has one reader.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

import pytest

from crescent.protos import common_pb2, decode_pb2, prefill_pb2
from crescent.services.decode.batcher import Batcher
from crescent.services.decode.pipeline import DecodePipeline, Refusal, Refused
from crescent.services.decode.request import ABORTED
from crescent.services.engine.engine import Engine
from crescent.services.instance.runtime import EngineWorker
from crescent.services.instance.wire import kv_dtype
from crescent.services.kvwire.handoff_tcp import TCP_REFUSAL
from crescent.services.kvwire.handoff_wire import handoff_parts
from crescent.services.kvwire.layer_wire import block_tokens
from crescent.services.prefill.batcher import PrefillBatcher
from crescent.services.prefill.load import PrefillLoad
from crescent.services.prefill.pipeline import FirstToken, HandedOff, PrefillPipeline
from tests.dataplane.families import through_the_wire
from tests.decode.support import METRICS, PAGE, prompt, running_batcher, tiny_engine

DECODE = "decode.test:1"


class PipelineSink:
    """A prefill ``HandoffSink`` whose Handoff is ``DecodePipeline.handoff``, in this process."""

    def __init__(self, decode: DecodePipeline) -> None:
        self.decode = decode

    def handoff(self, address: str):  # noqa: ANN201
        async def call(parts, timeout=None):  # noqa: ANN001
            await self.decode.handoff(through_the_wire(parts))
            return decode_pb2.HandoffReply(accepted=True)
        return call

    def open_handoff(self, address: str):  # noqa: ANN201
        return None  # no side channel: a layer-wise handoff's bytes go on the stream


@dataclass
class Stack:
    prefill: PrefillPipeline
    decode: DecodePipeline
    batcher: Batcher


@asynccontextmanager
async def stack(layerwise: bool = False, decode_tokens: int = 16 * PAGE) -> AsyncIterator[Stack]:
    """A prefill pipeline (its engine thread) handing off to a decode pipeline (a running batcher
    of its own engine)."""
    prefill_engine = tiny_engine(16 * PAGE)
    worker = EngineWorker("test-prefill")
    thread = threading.Thread(target=worker.serve_forever)
    thread.start()
    prefill_batcher = PrefillBatcher(prefill_engine, worker, 0, METRICS)
    tasks: list[asyncio.Task] = []
    try:
        async with running_batcher(tiny_engine(decode_tokens)) as batcher:
            decode = DecodePipeline(batcher)
            prefill = PrefillPipeline(engine=prefill_engine, worker=worker, batcher=prefill_batcher,
                                      metrics=METRICS, load=PrefillLoad(), sink=PipelineSink(decode),
                                      spawn=lambda c: tasks.append(asyncio.create_task(c)),
                                      layerwise_handoff=layerwise)
            yield Stack(prefill, decode, batcher)
    finally:
        await asyncio.gather(*tasks)
        await prefill_batcher.close()
        worker.shutdown()
        await asyncio.to_thread(thread.join)


async def prefill_one(prefill: PrefillPipeline, request_id: str, tokens: list[int], max_tokens: int) -> int:
    """Run one prompt through prefill until decode took it; its first token."""
    run = prefill.start(prefill_pb2.PrefillRequest(
        request_id=request_id, token_ids=tokens, decode_address=DECODE,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    try:
        events = [event async for event in run.events()]
    finally:
        await run.close()
    first, handed = events
    assert isinstance(first, FirstToken) and handed == HandedOff(DECODE)
    return first.token_id


async def read_stream(decode: DecodePipeline, request_id: str) -> tuple[list[int], str]:
    """Every token a StreamTokens call would send, and how it ended."""
    tokens, reason = [], ""
    async with aclosing(decode.stream(request_id)) as updates:
        async for update in updates:
            tokens.extend(update.token_ids)
            reason = update.finish_reason or reason
    return tokens, reason


def whole_parts(engine: Engine, request_id: str, tokens: list[int], max_tokens: int, **header) -> list:
    """A whole-block handoff of ``tokens``, prefilled on ``engine``: (header, KV chunks); ``header``
    overrides fields of the header."""
    seq = engine.add_sequence(request_id, tokens, use_cache=False)
    first = int(engine.prefill(seq).argmax())
    blocks = []
    for i in range(-(-len(tokens) // PAGE)):
        payload = engine.block_payload(seq, i, block_tokens(i, len(tokens), PAGE)).clone()
        blocks.append((common_pb2.BlockMeta(key=f"{request_id}/{i}".encode(), model_id="tiny",
                                            dtype=kv_dtype(engine.cache), shape=list(payload.shape),
                                            nbytes=payload.numel() * payload.element_size(), found=True),
                       payload.contiguous().view(-1).numpy().tobytes()))
    engine.release(seq)
    fields = dict(request_id=request_id, model_id="tiny", prompt_token_ids=tokens, first_token_id=first,
                  sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  kv_dtype=kv_dtype(engine.cache), kv_block_shape=list(engine.cache.block_shape),
                  num_blocks=len(blocks))
    return list(handoff_parts(decode_pb2.HandoffHeader(**{**fields, **header}), blocks))


def free_pages(batcher: Batcher) -> int:
    return batcher.engine.cache.pages.free_pages


class Counted:
    """An async iterator over ``parts`` that counts what was read of it."""

    def __init__(self, parts: list) -> None:
        self.parts, self.read = parts, 0

    async def __aiter__(self):  # noqa: ANN204
        async for part in through_the_wire(self.parts):
            self.read += 1
            yield part


async def refused(decode: DecodePipeline, parts) -> Refused:  # noqa: ANN001
    with pytest.raises(Refused) as caught:
        await decode.handoff(parts)
    return caught.value


@pytest.mark.parametrize("layerwise", [True, False], ids=["layer-wise", "whole"])
def test_a_handed_off_prompt_streams_the_tokens_one_process_generates(layerwise) -> None:
    tokens = prompt(3 * PAGE + 5, seed=1)  # 3 full blocks and a partial one
    expected = tiny_engine(16 * PAGE).generate(tokens, 10, stop_token_ids=[])

    async def scenario():
        async with stack(layerwise) as s:
            free, pages = s.batcher.free_kv_tokens, free_pages(s.batcher)
            first = await prefill_one(s.prefill, "r1", tokens, 10)
            promised = s.batcher.free_kv_tokens
            rest, reason = await read_stream(s.decode, "r1")
            await s.batcher.worker.run(lambda: None)  # the release, submitted before, has run
            return (first, rest, reason, promised, s.batcher.holds("r1"), (free, pages),
                    (s.batcher.free_kv_tokens, free_pages(s.batcher)))

    first, rest, reason, promised, held, before, after = asyncio.run(scenario())
    assert [first, *rest] == expected and reason == "length"
    assert promised < before[0], "the request's KV was promised while it ran"
    assert not held and after == before, "read to its end, it is forgotten and its KV goes back"


def test_what_the_header_decides_is_refused_before_any_kv_is_read() -> None:
    engine = tiny_engine(16 * PAGE)
    tokens = prompt(2 * PAGE + 3, seed=2)

    async def scenario():
        async with running_batcher(tiny_engine(4 * PAGE)) as batcher:
            decode = DecodePipeline(batcher)
            out = {}
            parts = Counted(whole_parts(engine, "big", tokens, 4 * PAGE))  # prompt + output > the cache
            out["big"] = (await refused(decode, parts), parts.read)
            assert not decode.abort("early", "client left"), "not here yet"
            parts = Counted(whole_parts(engine, "early", tokens, 4))
            out["early"] = (await refused(decode, parts), parts.read)
            await decode.handoff(through_the_wire(whole_parts(engine, "twice", tokens, 4)))
            parts = Counted(whole_parts(engine, "twice", tokens, 4))
            out["twice"] = (await refused(decode, parts), parts.read)
            batcher.draining = True
            parts = Counted(whole_parts(engine, "late", tokens, 4))
            out["late"] = (await refused(decode, parts), parts.read)
            return out, list(batcher.requests)

    out, held = asyncio.run(scenario())
    assert {k: (e.reason, read) for k, (e, read) in out.items()} == {
        "big": (Refusal.NEVER_FITS, 1), "early": (Refusal.ABORTED, 1), "twice": (Refusal.ALREADY_HERE, 1),
        "late": (Refusal.DRAINING, 0)}
    assert str(out["big"][0]).startswith(f"request needs {2 * PAGE + 3 + 4 * PAGE} KV tokens")
    assert held == ["twice"]


def test_a_malformed_or_unusable_handoff_admits_nothing() -> None:
    engine = tiny_engine(16 * PAGE)
    tokens = prompt(2 * PAGE + 3, seed=3)

    async def scenario():
        async with running_batcher(tiny_engine(16 * PAGE)) as batcher:
            decode = DecodePipeline(batcher)
            good = whole_parts(engine, "r", tokens, 4)
            cases = {
                "empty": [],
                "kv first": good[1:2] + good[:1] + good[2:],
                "two headers": good[:1] + good,
                "a block short": good[:-1],
                "another model": whole_parts(engine, "r", tokens, 4, model_id="another"),
                "bad first token": whole_parts(engine, "r", tokens, 4, first_token_id=10 ** 6),
            }
            out = {name: await refused(decode, through_the_wire(parts)) for name, parts in cases.items()}
            return out, dict(batcher.requests)

    out, held = asyncio.run(scenario())
    assert {name: e.reason for name, e in out.items()} == dict.fromkeys(out, Refusal.INVALID)
    assert str(out["empty"]) == "empty handoff"
    assert str(out["kv first"]).startswith("malformed handoff: KV block before the handoff header")
    assert "not 'another'" in str(out["another model"])
    assert held == {}


def test_a_reader_that_leaves_early_or_an_abort_ends_the_request_and_frees_its_kv() -> None:
    tokens = prompt(PAGE + 3, seed=4)

    async def scenario():
        async with stack() as s:
            free = s.batcher.free_kv_tokens, free_pages(s.batcher)
            with pytest.raises(Refused) as unknown:
                s.decode.stream("nobody")
            await prefill_one(s.prefill, "left", tokens, 64)
            updates = s.decode.stream("left")
            with pytest.raises(Refused) as second:
                s.decode.stream("left")
            async with aclosing(updates):
                await anext(updates)  # one update, then the reader goes away
            left_held = s.batcher.holds("left")

            await prefill_one(s.prefill, "aborted", tokens, 64)
            async with aclosing(s.decode.stream("aborted")) as updates:
                await anext(updates)
                assert s.decode.abort("aborted", "stop string")
                ending = [u async for u in updates][-1]
            await s.batcher.worker.run(lambda: None)  # the releases, submitted before, have run
            return (unknown.value, second.value, left_held, ending, s.batcher.holds("aborted"),
                    (s.batcher.free_kv_tokens, free_pages(s.batcher)), free)

    unknown, second, left_held, ending, aborted_held, free_after, free = asyncio.run(scenario())
    assert unknown.reason == Refusal.NOT_FOUND and second.reason == Refusal.ALREADY_HERE
    assert not left_held and not aborted_held
    assert ending.finish_reason == ABORTED and ending.detail == "aborted by the caller: stop string"
    assert free_after == free


def test_without_a_side_channel_open_handoff_asks_for_the_bytes() -> None:
    async def scenario():
        async with running_batcher(tiny_engine(4 * PAGE)) as batcher:
            with pytest.raises(Refused) as caught:
                DecodePipeline(batcher).open_handoff("r", 1024)
            return caught.value

    refusal = asyncio.run(scenario())
    assert refusal.reason == Refusal.RESEND and str(refusal).startswith(TCP_REFUSAL)
