"""Every stream that carries KV blocks goes through one codec (``kvwire.chunk_wire``).

What a user would notice: a peer's prefix pulled over FetchPrefix lands in this
engine's cache byte for byte as the peer holds it; the codec's bytes are protobuf's own, so
generated clients interoperate. (A prompt handed between real prefill and decode processes, and
its KV copied out of prefill's cache once: ``tests/dataplane/test_processes.py``.)
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import torch

from crescent.protos import common_pb2, decode_pb2, prefill_pb2, prefill_pb2_grpc
from crescent.services.common.metrics import engine_metrics
from crescent.services.engine.engine import Engine
from crescent.services.instance.runtime import EngineWorker
from crescent.services.kvwire import chunk_wire
from crescent.services.kvwire.handoff_wire import HandoffWirePart, decode_part, encode_part
from crescent.services.prefill.prefix_pull import PrefixPuller
from crescent.services.prefill.servicer import PrefillServicer, add_prefill_to_server
from tests.engine.tiny_model import tiny_model
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
