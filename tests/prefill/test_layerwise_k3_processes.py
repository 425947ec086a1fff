"""A kimi_k3 prompt handed from a real prefill process to a real decode process layer-wise.

What a user would notice: decode streams the tokens one process generates, layer-wise as whole
(whichever way prefill cut the prompt into forwards, and with a cached prefix); part of the
handoff went out before the prompt's last layer was computed; a layer-wise stream with a layer
or the state missing or repeated, or a layer before the one it follows, is refused (INVALID_ARGUMENT) and nothing is admitted.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from crescent.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from crescent.services.engine.engine import Engine
from crescent.services.engine.kimi_k3.loading import load_k3_model
from crescent.services.kvwire.chunk_wire import WireChunk
from crescent.services.kvwire.handoff_wire import HandoffWirePart, encode_part
from crescent.services.kvwire.layer_wire import block_tokens, layer_slice
from crescent.services.model.model_source import resolve_model
from tests.decode.process import DecodeProcess, SchedulerStandIn, decode_stub, stream_all

pytestmark = pytest.mark.slow

MODEL, PAGE, VOCAB = "kimi-k3-nano", 16, 163840
METRIC = "crescent_engine_kv_transfer_bytes_total"


def engine_settings(**extra) -> dict:
    # a snapshot at every block (the default keeps every 16th): the hits below end mid-prompt
    return {"engine": {"model": MODEL, "kv_capacity_tokens": 2048, "block_size": PAGE, "threads": 1,
                       "max_batch_size": 4, "min_cached_prompt_tokens": 0, "state_snapshot_every_blocks": 1, **extra}}


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB - 8, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def through(prefill: DecodeProcess, decode: DecodeProcess, request_id: str, tokens: list[int], n: int) -> tuple[list[int], int]:
    """(the tokens the client sees, the prompt tokens prefill found cached)."""
    with grpc.insecure_channel(prefill.address) as channel:
        events = list(prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
            request_id=request_id, token_ids=tokens, decode_address=decode.address,
            sampling=common_pb2.SamplingParams(max_tokens=n, ignore_eos=True)), timeout=120))
    assert [e.WhichOneof("event") for e in events] == ["first_token", "handed_off"]
    channel, stub = decode_stub(decode.address)
    with channel:
        rest, reason = stream_all(stub, request_id)
    assert reason == "length"
    return [events[0].first_token.token_id, *rest], events[0].first_token.cached_tokens


def test_a_k3_prompt_handed_off_layerwise_decodes_as_one_process(tmp_path) -> None:
    torch.set_num_threads(1)
    reference = Engine(load_k3_model(resolve_model(MODEL)), model_id=MODEL, kv_capacity_tokens=4096, block_size=PAGE)
    scheduler = SchedulerStandIn()
    dirs = [tmp_path / name for name in ("decode", "on", "off")]
    for d in dirs:
        d.mkdir()
    decode = DecodeProcess(dirs[0], scheduler.address, 2048, extra=engine_settings())
    on = DecodeProcess(dirs[1], scheduler.address, 2048, role="prefill",
                       extra={"layerwise_handoff": True, **engine_settings(prefill_chunk_tokens=48)})
    off = DecodeProcess(dirs[2], scheduler.address, 2048, role="prefill",
                        extra={"layerwise_handoff": False, **engine_settings()})
    try:
        for process in (decode, on, off):
            process.start()
        tokens = prompt(10 * PAGE + 9, seed=1)  # 10 full blocks, a partial one; 4 forwards of 48 on "on"
        expected = reference.generate(tokens, 8, stop_token_ids=[])
        assert through(on, decode, "on", tokens, 8) == (expected, 0)
        assert through(off, decode, "off", tokens, 8) == (expected, 0)
        assert 0 < on.metric(METRIC, direction="handoff_hidden") < on.metric(METRIC, direction="handoff_out")
        assert off.metric(METRIC, direction="handoff_hidden") == 0
        # on one host the layer-wise handoff's KV (the latents, the state) went through shared memory
        assert on.metric("crescent_handoff_total", peer=decode.address, mover="shm") == 1

        again = tokens[: 6 * PAGE] + prompt(3 * PAGE + 2, seed=2)  # 6 blocks cached on "on": they go whole
        reply, cached = through(on, decode, "again", again, 6)
        assert cached == 6 * PAGE and reply == reference.generate(again, 6, stop_token_ids=[])
        refused_broken_streams(decode.address, reference, tokens)
    finally:
        for process in (on, off, decode):
            process.stop()
        scheduler.stop()


def refused_broken_streams(address: str, engine: Engine, tokens: list[int]) -> None:
    layout = engine.cache.layer_layout()
    blocks = -(-len(tokens) // PAGE)

    def parts(request_id: str, order: list[tuple[int, int]], states: int):
        yield HandoffWirePart(header=decode_pb2.HandoffHeader(
            request_id=request_id, model_id=MODEL, prompt_token_ids=tokens, num_layers=layout.num_layers,
            sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True), kv_dtype="float32",
            kv_block_shape=list(engine.cache.block_shape), num_blocks=blocks))
        for layer, block in order:
            size = block_tokens(block, len(tokens), PAGE)
            yield HandoffWirePart(layer=layer_slice(layer, block, [memoryview(bytes(layout.layer_bytes(size)))], size))
        for _ in range(states):
            meta = common_pb2.BlockMeta(key=b"s", dtype="float32", shape=[layout.state_bytes // 4],
                                        nbytes=layout.state_bytes, found=True)
            yield HandoffWirePart(state=WireChunk(meta=meta, data=bytes(layout.state_bytes), last=True))
        yield HandoffWirePart(tail=decode_pb2.HandoffTail(first_token_id=1))

    every = [(layer, b) for layer in range(layout.num_layers) for b in range(blocks)]
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_unary("/crescent.v1.Decode/Handoff", request_serializer=encode_part,
                                    response_deserializer=decode_pb2.HandoffReply.FromString)
        for name, order, states, says in [("missing", every[:-1], 1, "never arrived"),
                                          ("twice", [*every[:2], every[0]], 1, "arrived again"),
                                          ("reordered", [(1, 0), (0, 0)], 1, "arrived before layer 0"),
                                          ("no-state", every, 0, "state of the last block never arrived"),
                                          ("two-states", every, 2, "state arrived again")]:
            with pytest.raises(grpc.RpcError) as caught:
                call(parts(name, order, states), timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in caught.value.details()
            with pytest.raises(grpc.RpcError) as gone:  # nothing was accepted
                list(decode_pb2_grpc.DecodeStub(channel).StreamTokens(decode_pb2.StreamRequest(request_id=name), timeout=10))
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
