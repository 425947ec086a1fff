"""Every stream that carries KV blocks goes through one codec (``kvwire.chunk_wire``).

What a user would notice: a prompt handed from a real prefill process to a real decode process
decodes the same tokens as one process; a peer's prefix pulled over FetchPrefix lands in this
engine's cache byte for byte as the peer holds it; the codec's bytes are protobuf's own, so
generated clients interoperate; and a cold prompt's KV is copied out of prefill's cache once,
for both the kvstore and the handoff.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

import grpc
import pytest
import torch

from crescent.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from crescent.services.common.metrics import engine_metrics
from crescent.services.engine.engine import Engine
from crescent.services.instance.runtime import EngineWorker
from crescent.services.kvwire import chunk_wire
from crescent.services.kvwire.handoff_wire import HandoffWirePart, decode_part, encode_part
from crescent.services.kvwire.layer_wire import layer_slice
from crescent.services.prefill.prefix_pull import PrefixPuller
from crescent.services.prefill.servicer import PrefillServicer, add_prefill_to_server
from tests.decode.process import BLOCK, TEXTS, DecodeProcess, PromptKv, SchedulerStandIn, decode_stub, stream_all
from tests.engine.tiny_model import tiny_model
from tests.kvstore.conftest import start_node
from tests.prefill.test_prefix_pull import FixedDirectory

PAGE = 16


# ---- the handoff envelope: protobuf's bytes, without protobuf's copies -----------------------------

def test_handoff_parts_are_byte_for_byte_the_generated_messages() -> None:
    header = decode_pb2.HandoffHeader(request_id="r1", model_id="m", prompt_token_ids=[1, 2, 3], first_token_id=7,
                                      kv_dtype="float32", kv_block_shape=[2, 3], num_blocks=1)
    meta = common_pb2.BlockMeta(key=b"r1/0", model_id="m", dtype="float32", shape=[2, 3], nbytes=24, found=True)
    payload = bytes(range(24))
    for part, reference in [
        (HandoffWirePart(header=header), decode_pb2.HandoffPart(header=header)),
        (HandoffWirePart(block=chunk_wire.WireChunk(meta=meta, data=payload, last=True)),
         decode_pb2.HandoffPart(block=common_pb2.BlockChunk(meta=meta, data=payload, last=True))),
    ]:
        raw = encode_part(part)
        assert raw == reference.SerializeToString()
        assert decode_pb2.HandoffPart.FromString(raw) == reference
        back = decode_part(reference.SerializeToString())
        assert not back.error
        if part.header is not None:
            assert back.header == header and back.block is None
        else:
            assert back.block.meta == meta and bytes(back.block.data) == payload and back.block.last


def test_a_malformed_handoff_part_is_an_error_not_an_exception() -> None:
    assert "neither a header, a block" in decode_part(b"").error
    assert "malformed" in decode_part(b"\x12\x05ab").error  # a block field longer than the message
    broken_block = b"\x12\x03\x0a\x7f\x00"  # a meta inside the block running past its end
    assert decode_part(broken_block).error


# ---- peer prefix pulls: a real FetchPrefix server on loopback --------------------------------------

def test_a_pulled_prefix_is_the_peer_s_blocks_byte_for_byte() -> None:
    torch.set_num_threads(1)
    source = Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=16 * PAGE, block_size=PAGE)
    puller_engine = Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=16 * PAGE, block_size=PAGE)
    tokens = [(7 * i + 3) % 90 for i in range(5 * PAGE + 3)]
    held = source.add_sequence("src", tokens)
    source.prefill(held)  # the peer's cache now holds the prompt's 5 full blocks
    source_pages = [source.cache.read_block(p).clone() for p in held.pages[:5]]
    workers = [EngineWorker("source"), EngineWorker("puller")]
    threads = [threading.Thread(target=w.serve_forever) for w in workers]
    for t in threads:
        t.start()

    async def scenario() -> tuple[int, list[torch.Tensor], list[bytes], list[bytes]]:
        server = grpc.aio.server()
        add_prefill_to_server(PrefillServicer(source, workers[0], None, 0, lambda: None), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        puller = PrefixPuller(puller_engine, workers[1], engine_metrics("prefill"), FixedDirectory({"prefill-0": address}))
        seq = puller_engine.add_sequence("dst", tokens)
        try:
            added = await puller.pull(seq, "prefill-0", 5)
            pulled = [puller_engine.cache.read_block(p).clone() for p in seq.pages[: added // PAGE]]
            # The same stream read with the generated code (protobuf's own decoder) and with ours.
            request = prefill_pb2.FetchPrefixRequest(model_id="tiny", block_keys=seq.block_keys[:5],
                                                     token_ids=tokens[: 5 * PAGE])
            async with grpc.aio.insecure_channel(address) as channel:
                generated = [bytes(c.data) async for c in prefill_pb2_grpc.PrefillStub(channel).FetchPrefix(request)]
                ours = [bytes(c.data) async for c in channel.unary_stream(
                    "/crescent.v1.Prefill/FetchPrefix", request_serializer=prefill_pb2.FetchPrefixRequest.SerializeToString,
                    response_deserializer=chunk_wire.decode_chunk)(request)]
            return added, pulled, generated, ours
        finally:
            await puller.close()
            await server.stop(0)

    try:
        added, pulled, generated, ours = asyncio.run(scenario())
    finally:
        for w in workers:
            w.shutdown()
        for t in threads:
            t.join()
    assert added == 5 * PAGE
    assert all(torch.equal(a, b) for a, b in zip(pulled, source_pages)) and len(pulled) == 5
    assert generated == ours and len(generated) == 5
    assert [torch.frombuffer(bytearray(b), dtype=torch.float32).view(source.cache.block_shape).equal(p)
            for b, p in zip(ours, source_pages)] == [True] * 5


# ---- the handoff between real processes, and one copy of a cold prompt's KV ----------------------

@pytest.mark.slow
@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
def test_a_cold_prompt_is_copied_once_and_decode_continues_it_exactly(tmp_path, layerwise) -> None:
    prompts = PromptKv()
    scheduler = SchedulerStandIn()
    kvstore = start_node({"shared_memory": True}, tmp_path, "kv")
    decode = DecodeProcess(tmp_path, scheduler.address, 8 * BLOCK)
    prefill = DecodeProcess(tmp_path, scheduler.address, 8 * BLOCK, role="prefill",
                            extra={"kvstore_address": kvstore.address, "layerwise_handoff": layerwise})
    try:
        decode.start()
        prefill.start()
        tokens = prompts.prompt(TEXTS[3] * 16)[: 4 * BLOCK + 21]  # 4 full blocks (past min_cached_prompt_tokens) and a partial one
        assert len(tokens) == 4 * BLOCK + 21
        expected = prompts.reference(tokens, 12)
        events = []
        with grpc.insecure_channel(prefill.address) as channel:
            for event in prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                    request_id="cold", token_ids=tokens, decode_address=decode.address,
                    sampling=common_pb2.SamplingParams(max_tokens=12, ignore_eos=True)), timeout=120):
                events.append(event)
        assert [e.WhichOneof("event") for e in events] == ["first_token", "handed_off"]
        channel, stub = decode_stub(decode.address)
        with channel:
            rest, reason = stream_all(stub, "cold")
        assert [events[0].first_token.token_id, *rest] == expected and reason == "length"

        per_token = 4 * math.prod(prompts.engine.cache.payload_shape(1))  # float32 KV of one token
        deadline = time.monotonic() + 30
        while prefill.metric("crescent_engine_kv_transfer_bytes_total", direction="to_kvstore") == 0:
            assert time.monotonic() < deadline, "the new blocks should reach the kvstore"
            time.sleep(0.1)
        copied = prefill.metric("crescent_engine_kv_transfer_bytes_total", direction="copied_out")
        assert prefill.metric("crescent_engine_kv_transfer_bytes_total", direction="handoff_out") == len(tokens) * per_token
        assert prefill.metric("crescent_engine_kv_transfer_bytes_total", direction="to_kvstore") == 4 * BLOCK * per_token
        if layerwise:  # each block copied out of the cache once, for decode and the kvstore's pool both
            assert copied == len(tokens) * per_token
        else:  # once for decode after the prompt, and the new full blocks once more, straight into the
            assert copied == (len(tokens) + 4 * BLOCK) * per_token  # pool during the prompt
        assert prefill.metric("crescent_kv_mover_bytes_total", mover="shm-layers", direction="put") == 4 * BLOCK * per_token
        assert kvstore.metric("crescent_kvstore_blocks", tier="host") == 4
        hidden = prefill.metric("crescent_engine_kv_transfer_bytes_total", direction="handoff_hidden")
        assert (0 <= hidden <= len(tokens) * per_token) if layerwise else hidden == 0
        if layerwise:
            refused_broken_layerwise_handoffs(decode.address, prompts, tokens)
    finally:
        prefill.stop()
        decode.stop()
        kvstore.stop()
        scheduler.stop()


def refused_broken_layerwise_handoffs(address: str, prompts: PromptKv, tokens: list[int]) -> None:
    """A real decode process refuses a layer-wise stream with a layer missing, repeated or
    without its tail (INVALID_ARGUMENT) and takes no request from it."""
    engine = prompts.engine
    per_token, layers = engine.cache.token_layer_bytes(), engine.config.num_layers
    blocks = -(-len(tokens) // BLOCK)

    def parts(request_id: str, order: list[tuple[int, int]], tail: bool = True):
        yield HandoffWirePart(header=decode_pb2.HandoffHeader(
            request_id=request_id, model_id=engine.model_id, prompt_token_ids=tokens, num_layers=layers,
            sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True), kv_dtype="float32",
            kv_block_shape=list(engine.cache.block_shape), num_blocks=blocks))
        for layer, block in order:
            size = min(BLOCK, len(tokens) - block * BLOCK)
            yield HandoffWirePart(layer=layer_slice(layer, block, [memoryview(bytes(size * per_token))], size))
        if tail:
            yield HandoffWirePart(tail=decode_pb2.HandoffTail(first_token_id=1))

    every = [(layer, b) for layer in range(layers) for b in range(blocks)]
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_unary("/crescent.v1.Decode/Handoff", request_serializer=encode_part,
                                    response_deserializer=decode_pb2.HandoffReply.FromString)
        for name, order, tail, says in [("missing", every[:-1], True, "never arrived"),
                                        ("twice", [*every[:2], every[0]], True, "arrived again"),
                                        ("no-tail", every, False, "without its tail")]:
            with pytest.raises(grpc.RpcError) as caught:
                call(parts(name, order, tail), timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in caught.value.details()
            with pytest.raises(grpc.RpcError) as gone:  # nothing was accepted
                list(decode_pb2_grpc.DecodeStub(channel).StreamTokens(decode_pb2.StreamRequest(request_id=name), timeout=10))
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
