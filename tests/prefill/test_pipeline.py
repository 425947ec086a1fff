"""The prefill pipeline in-process (``services/prefill/pipeline.py``), no network: a fake handoff
sink lands what prefill sends with decode's own ``HandoffIntake``.

What a user would notice: the first token streams before the handoff, decode gets exactly the
bytes prefill's cache holds — a layer at a time or whole — with the first token in the header;
a choice that ends at its first token hands nothing off; a decode that refuses ends the run as
a failed handoff after the first token, and the prompt's pages go back either way.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from crescent.protos import common_pb2, decode_pb2, prefill_pb2
from crescent.services.common.metrics import engine_metrics
from crescent.services.decode.handoff_in import HandoffIntake
from crescent.services.engine.engine import Engine
from crescent.services.instance.runtime import EngineWorker
from crescent.services.kvwire.layer_wire import block_tokens
from crescent.services.prefill.batcher import PrefillBatcher
from crescent.services.prefill.load import PrefillLoad
from crescent.services.prefill.pipeline import FirstToken, HandedOff, HandoffFailed, PrefillPipeline
from tests.dataplane.families import through_the_wire
from tests.engine.tiny_model import tiny_model

PAGE = 4
DECODE = "decode.test:1"


def make_engine() -> Engine:
    torch.set_num_threads(1)
    return Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=64 * PAGE, block_size=PAGE,
                  prefill_chunk_tokens=8)


class LandingSink:
    """A ``HandoffSink`` whose Handoff is decode's landing code, in this process: each part goes
    through the wire codec, then ``HandoffIntake.land`` (``refuse``: fail the call instead)."""

    def __init__(self, engine: Engine, refuse: grpc.StatusCode | None = None) -> None:
        self.intake = HandoffIntake(engine)
        self.refuse = refuse
        self.landed = []
        self.addresses: list[str] = []
        self.order: list[str] = []  # "handoff" when the handoff's reply came

    def handoff(self, address: str):  # noqa: ANN201
        self.addresses.append(address)

        async def call(parts, timeout=None):  # noqa: ANN001
            async def on_header(header: decode_pb2.HandoffHeader) -> None:
                if self.refuse is not None:
                    raise grpc.aio.AioRpcError(self.refuse, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               "refused")

            self.landed.append(await self.intake.land(through_the_wire(parts), on_header))
            self.order.append("handoff")
            return decode_pb2.HandoffReply(accepted=True)
        return call

    def open_handoff(self, address: str):  # noqa: ANN201
        return None  # no side channel: a layer-wise handoff's bytes go on the stream


def run_pipeline(engine: Engine, request: prefill_pb2.PrefillRequest, sink: LandingSink, *,
                 layerwise: bool) -> tuple[list, BaseException | None, int]:
    """Drive one request through a ``PrefillPipeline`` on an engine thread, as a prefill process
    does; (its events, the error it ended with, the cache's free pages after ``close``)."""
    worker = EngineWorker("prefill")
    thread = threading.Thread(target=worker.serve_forever)
    thread.start()

    async def main():
        metrics = engine_metrics("prefill")
        batcher = PrefillBatcher(engine, worker, 0, metrics)
        tasks: list[asyncio.Task] = []
        pipeline = PrefillPipeline(engine=engine, worker=worker, batcher=batcher, metrics=metrics,
                                   load=PrefillLoad(), sink=sink,
                                   spawn=lambda c: tasks.append(asyncio.create_task(c)),
                                   layerwise_handoff=layerwise)
        run = pipeline.start(request)
        events, error = [], None
        try:
            async for event in run.events():
                events.append(event)
                sink.order.append(type(event).__name__)
        except HandoffFailed as exc:
            error = exc
        finally:
            await run.close()
        await asyncio.gather(*tasks)
        await batcher.close()
        await worker.run(lambda: None)  # the pages' release, submitted by close, has run
        return events, error, engine.cache.pages.free_pages
    try:
        return asyncio.run(main())
    finally:
        worker.shutdown()
        thread.join()


def request(tokens: list[int], max_tokens: int = 4, n: int = 1) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(request_id="r1", token_ids=tokens, decode_address=DECODE,
                                      sampling=common_pb2.SamplingParams(max_tokens=max_tokens, n=n))


def prompt_bytes(engine: Engine, prompt: list[int]) -> list[bytes]:
    """The prompt's KV as the cache holds it, computed again on a fresh sequence."""
    seq = engine.add_sequence("again", prompt)
    engine.prefill(seq)
    out = [engine.block_payload(seq, i, block_tokens(i, len(prompt), PAGE)).contiguous().view(torch.uint8)
           .numpy().tobytes() for i in range(-(-len(prompt) // PAGE))]
    engine.release(seq)
    return out


@pytest.mark.parametrize("layerwise", [True, False], ids=["layer-wise", "whole"])
def test_the_first_token_streams_then_decode_lands_exactly_the_cache_s_bytes(layerwise) -> None:
    engine = make_engine()
    free = engine.cache.pages.free_pages
    tokens = [(7 * i + 3) % 97 for i in range(19)]  # 4 full blocks in 3 chunks, and a partial one
    sink = LandingSink(engine)
    events, error, free_after = run_pipeline(engine, request(tokens), sink, layerwise=layerwise)
    assert error is None and free_after == free, "the prompt's pages went back"
    first, handed = events
    assert isinstance(first, FirstToken) and first.prompt_tokens == 19 and first.finish_reason == ""
    assert handed == HandedOff(DECODE) and sink.addresses == [DECODE]
    assert sink.order == ["FirstToken", "handoff", "HandedOff"], "the first token waits for no handoff"
    landed = sink.landed[0]
    assert landed.header.first_token_id == first.token_id and list(landed.header.prompt_token_ids) == tokens
    landed_bytes = [p.contiguous().view(torch.uint8).numpy().tobytes() for p in landed.payloads]
    assert landed_bytes == prompt_bytes(engine, tokens)
    assert sink.intake.problem(landed.header, landed.payloads) is None, "decode would accept it"
    landed.header.model_id = "another"
    assert "not 'another'" in sink.intake.problem(landed.header, landed.payloads)


def test_a_choice_that_ends_at_its_first_token_hands_nothing_off() -> None:
    engine = make_engine()
    sink = LandingSink(engine)
    events, error, _ = run_pipeline(engine, request([5, 6, 7, 8, 9], max_tokens=1), sink, layerwise=False)
    assert error is None and [type(e) for e in events] == [FirstToken] and events[0].finish_reason == "length"
    assert sink.addresses == []


@pytest.mark.parametrize("layerwise", [True, False], ids=["layer-wise", "whole"])
def test_a_refused_handoff_fails_the_run_after_the_first_token_and_the_pages_go_back(layerwise) -> None:
    engine = make_engine()
    free = engine.cache.pages.free_pages
    sink = LandingSink(engine, refuse=grpc.StatusCode.RESOURCE_EXHAUSTED)
    events, error, free_after = run_pipeline(engine, request(list(range(1, 14))), sink, layerwise=layerwise)
    assert [type(e) for e in events] == [FirstToken]
    assert isinstance(error, HandoffFailed) and error.cause.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(error).startswith(f"handoff to decode {DECODE} failed: RESOURCE_EXHAUSTED")
    assert free_after == free
