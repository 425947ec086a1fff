"""The data-plane matrix through real processes: prompts handed from a real prefill process to a
real decode process layer-wise and whole, and the layer-wise kvstore export of a real prefill
process into a real kvstore node, on and off, for both model families.

What a user would notice: decode streams the tokens one process generates, layer-wise as whole
(and, for kimi_k3, with a cached prefix, whichever way prefill cut the prompt into forwards); a
cold prompt's KV is copied out of prefill's cache once, for the kvstore and the handoff; a
layer-wise stream with a layer (or kimi_k3's state) missing or repeated, or out of order, or
without its tail, is refused (INVALID_ARGUMENT) and nothing is admitted; with
``layerwise_kvstore`` on (the default) a cold prompt's new blocks reach the node through its
pool as the prompt computes (``crescent_kv_mover_bytes{mover="shm-layers"}``) and read back
exactly as the whole-block export after the prompt stores them (``mover="shm"``, the setting
off); a prompt whose caller leaves midway stores nothing and gives its reserved room back.
(How much lands before the prompt's last layer, which a loaded machine's timing decides here, is
checked paced in ``test_layerwise_store.py``.)
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

from crescent.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from crescent.services.engine.engine import Engine
from crescent.services.engine.kimi_k3.loading import load_k3_model
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvwire.handoff_wire import encode_part
from crescent.services.model.model_source import resolve_model
from tests.dataplane.families import MIB, broken_stream, stored_blocks
from tests.decode.process import BLOCK, TEXTS, DecodeProcess, PromptKv, SchedulerStandIn, decode_stub, stream_all
from tests.kvstore.conftest import start_node

pytestmark = pytest.mark.slow  # real processes: a model load each

K3_MODEL, K3_PAGE, K3_VOCAB = "kimi-k3-nano", 16, 163840
TRANSFER = "crescent_engine_kv_transfer_bytes_total"
MOVER = "crescent_kv_mover_bytes_total"


def refuses_broken_streams(address: str, engine: Engine, tokens: list[int], cases: list[tuple]) -> None:
    """A real decode process refuses each broken layer-wise stream of ``cases`` ((name, slices,
    states, tail, what the refusal says)) with INVALID_ARGUMENT and admits nothing from it."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_unary("/crescent.v1.Decode/Handoff", request_serializer=encode_part,
                                    response_deserializer=decode_pb2.HandoffReply.FromString)
        for name, order, states, tail, says in cases:
            with pytest.raises(grpc.RpcError) as caught:
                call(broken_stream(engine, name, tokens, order, states, tail), timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in caught.value.details()
            with pytest.raises(grpc.RpcError) as gone:  # nothing was accepted
                list(decode_pb2_grpc.DecodeStub(channel).StreamTokens(decode_pb2.StreamRequest(request_id=name), timeout=10))
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def every_slice(engine: Engine, tokens: list[int]) -> list[tuple[int, int]]:
    """Every (layer, block) of a layer-wise stream of ``tokens``, layer by layer."""
    blocks = -(-len(tokens) // engine.block_size)
    return [(layer, b) for layer in range(engine.cache.layer_layout().num_layers) for b in range(blocks)]


def through(prefill: DecodeProcess, decode: DecodeProcess, request_id: str, tokens: list[int], n: int) -> tuple[list[int], int]:
    """Prefill, hand off, stream: (the tokens the client sees, the prompt tokens prefill found cached)."""
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


# ---- the handoff: llama ----------------------------------------------------------------------------

@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
def test_a_cold_llama_prompt_is_copied_once_and_decode_continues_it_exactly(tmp_path, layerwise) -> None:
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
        assert through(prefill, decode, "cold", tokens, 12)[0] == expected

        per_token = 4 * math.prod(prompts.engine.cache.payload_shape(1))  # float32 KV of one token
        deadline = time.monotonic() + 30
        while prefill.metric(TRANSFER, direction="to_kvstore") == 0:
            assert time.monotonic() < deadline, "the new blocks should reach the kvstore"
            time.sleep(0.1)
        copied = prefill.metric(TRANSFER, direction="copied_out")
        assert prefill.metric(TRANSFER, direction="handoff_out") == len(tokens) * per_token
        assert prefill.metric(TRANSFER, direction="to_kvstore") == 4 * BLOCK * per_token
        if layerwise:  # each block copied out of the cache once, for decode and the kvstore's pool both
            assert copied == len(tokens) * per_token
        else:  # once for decode after the prompt, and the new full blocks once more, straight into the
            assert copied == (len(tokens) + 4 * BLOCK) * per_token  # pool during the prompt
        assert prefill.metric(MOVER, mover="shm-layers", direction="put") == 4 * BLOCK * per_token
        assert kvstore.metric("crescent_kvstore_blocks", tier="host") == 4
        hidden = prefill.metric(TRANSFER, direction="handoff_hidden")
        assert (0 <= hidden <= len(tokens) * per_token) if layerwise else hidden == 0
        if layerwise:
            every = every_slice(prompts.engine, tokens)
            refuses_broken_streams(decode.address, prompts.engine, tokens, [
                ("missing", every[:-1], 0, True, "never arrived"),
                ("twice", [*every[:2], every[0]], 0, True, "arrived again"),
                ("no-tail", every, 0, False, "without its tail")])
    finally:
        prefill.stop()
        decode.stop()
        kvstore.stop()
        scheduler.stop()


# ---- the handoff: kimi_k3 --------------------------------------------------------------------------

def k3_settings(**extra) -> dict:
    # a snapshot at every block (the default keeps every 16th): the hits below end mid-prompt
    return {"engine": {"model": K3_MODEL, "kv_capacity_tokens": 2048, "block_size": K3_PAGE, "threads": 1,
                       "max_batch_size": 4, "min_cached_prompt_tokens": 0, "state_snapshot_every_blocks": 1, **extra}}


def k3_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, K3_VOCAB - 8, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_k3_prompt_handed_off_layerwise_decodes_as_one_process(tmp_path) -> None:
    torch.set_num_threads(1)
    reference = Engine(load_k3_model(resolve_model(K3_MODEL)), model_id=K3_MODEL, kv_capacity_tokens=4096,
                       block_size=K3_PAGE)
    scheduler = SchedulerStandIn()
    dirs = [tmp_path / name for name in ("decode", "on", "off")]
    for d in dirs:
        d.mkdir()
    decode = DecodeProcess(dirs[0], scheduler.address, 2048, extra=k3_settings())
    on = DecodeProcess(dirs[1], scheduler.address, 2048, role="prefill",
                       extra={"layerwise_handoff": True, **k3_settings(prefill_chunk_tokens=48)})
    off = DecodeProcess(dirs[2], scheduler.address, 2048, role="prefill",
                        extra={"layerwise_handoff": False, **k3_settings()})
    try:
        for process in (decode, on, off):
            process.start()
        tokens = k3_prompt(10 * K3_PAGE + 9, seed=1)  # 10 full blocks, a partial one; 4 forwards of 48 on "on"
        expected = reference.generate(tokens, 8, stop_token_ids=[])
        assert through(on, decode, "on", tokens, 8) == (expected, 0)
        assert through(off, decode, "off", tokens, 8) == (expected, 0)
        assert 0 < on.metric(TRANSFER, direction="handoff_hidden") < on.metric(TRANSFER, direction="handoff_out")
        assert off.metric(TRANSFER, direction="handoff_hidden") == 0
        # on one host the layer-wise handoff's KV (the latents, the state) went through shared memory
        assert on.metric("crescent_handoff_total", peer=decode.address, mover="shm") == 1

        again = tokens[: 6 * K3_PAGE] + k3_prompt(3 * K3_PAGE + 2, seed=2)  # 6 blocks cached on "on": they go whole
        reply, cached = through(on, decode, "again", again, 6)
        assert cached == 6 * K3_PAGE and reply == reference.generate(again, 6, stop_token_ids=[])
        every = every_slice(reference, tokens)
        refuses_broken_streams(decode.address, reference, tokens, [
            ("missing", every[:-1], 1, True, "never arrived"),
            ("twice", [*every[:2], every[0]], 1, True, "arrived again"),
            ("reordered", [(1, 0), (0, 0)], 1, True, "arrived before layer 0"),
            ("no-state", every, 0, True, "state of the last block never arrived"),
            ("two-states", every, 2, True, "state arrived again")])
    finally:
        for process in (on, off, decode):
            process.stop()
        scheduler.stop()


# ---- the layer-wise kvstore export, on and off -----------------------------------------------------

@dataclass(frozen=True)
class StoreCase:
    engine: dict          # the prefill's engine settings
    capacity: int         # its KV tokens
    tokens: list[int]
    blocks: int           # new full blocks the prompt stores
    model: str = ""       # "": the default model
    extra: dict = field(default_factory=dict)


STORE_CASES = {
    # 4 full blocks (over the 256-token cache rule) and a partial one, in two chunks and a bit: blocks
    # committed while later chunks compute; the last chunk has no full block
    "llama": StoreCase({"kv_capacity_tokens": 8 * BLOCK, "block_size": BLOCK, "threads": 1, "prefill_chunk_tokens": 2 * BLOCK},
                       8 * BLOCK, torch.randint(10, 40000, (4 * BLOCK + 44,), generator=torch.Generator().manual_seed(3)).tolist(), 4),
    # 10 blocks and 9 tokens: 4 forwards of 48 tokens, the last completing one block; a pool of 4 state
    # snapshots (evicted on the way), one at every block (the default keeps every 16th)
    "k3": StoreCase({"model": K3_MODEL, "kv_capacity_tokens": 1024, "block_size": K3_PAGE, "threads": 1,
                     "min_cached_prompt_tokens": 0, "prefill_chunk_tokens": 3 * K3_PAGE, "state_snapshots": 4,
                     "state_snapshot_every_blocks": 1},
                    1024, torch.randint(2, K3_VOCAB - 8, (10 * K3_PAGE + 9,), generator=torch.Generator().manual_seed(7)).tolist(), 10),
}


@pytest.mark.parametrize("family", list(STORE_CASES))
def test_layerwise_export_on_stores_what_the_whole_export_stores(tmp_path, kvstore_node, family) -> None:
    case = STORE_CASES[family]
    scheduler = SchedulerStandIn()
    nodes = {name: kvstore_node({"tiers": {"host": {"capacity_bytes": 64 * MIB}}}, name=name) for name in ("on", "off")}
    prefills = {}
    for name, node in nodes.items():
        (tmp_path / name).mkdir()
        prefills[name] = DecodeProcess(tmp_path / name, scheduler.address, case.capacity, role="prefill",
                                       extra={"kvstore_address": node.address, "layerwise_kvstore": name == "on",
                                              "engine": case.engine})
    try:
        for process in prefills.values():
            process.start()
        for name, process in prefills.items():
            with grpc.insecure_channel(process.address) as channel:
                events = list(prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                    request_id=f"r-{name}", token_ids=case.tokens, sampling=common_pb2.SamplingParams(max_tokens=1),
                ), timeout=120))
            assert events[0].first_token.finished
        on, off = (stored_blocks(nodes[name].address, case.blocks) for name in ("on", "off"))
        assert len(on) == case.blocks and [b.to_meta() for b in on] == [b.to_meta() for b in off]
        assert [bytes(b.payload) for b in on] == [bytes(b.payload) for b in off]
        kv_bytes = sum(b.nbytes for b in on)
        assert prefills["on"].metric(MOVER, mover="shm-layers", direction="put") == kv_bytes
        assert prefills["on"].metric(MOVER, mover="shm", direction="put") == 0
        assert prefills["off"].metric(MOVER, mover="shm-layers", direction="put") == 0
        assert prefills["off"].metric(MOVER, mover="shm", direction="put") == kv_bytes
        assert prefills["off"].metric(TRANSFER, direction="to_kvstore_hidden") == 0
        if family == "llama":  # the last chunk has no full block: every layer of every new block landed before the prompt ended
            assert prefills["on"].metric(TRANSFER, direction="to_kvstore_hidden") == kv_bytes
        else:  # the blocks whose snapshots the pool kept carry them
            assert sum(len(b.shape) == 1 for b in on) == 4
    finally:
        for process in prefills.values():
            process.stop()
        scheduler.stop()


def test_a_llama_prompt_cancelled_midway_leaves_no_block_and_gives_its_room_back(tmp_path: Path, kvstore_node) -> None:
    scheduler = SchedulerStandIn()
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 64 * MIB}}})
    engine = {"kv_capacity_tokens": 32 * BLOCK, "block_size": BLOCK, "threads": 1, "prefill_chunk_tokens": 32 * BLOCK}
    (tmp_path / "p").mkdir()
    prefill = DecodeProcess(tmp_path / "p", scheduler.address, 32 * BLOCK, role="prefill",
                            extra={"kvstore_address": node.address, "engine": engine})
    tokens = torch.randint(10, 40000, (16 * BLOCK,), generator=torch.Generator().manual_seed(5)).tolist()

    def host() -> tuple[int, int]:  # (blocks, reserved bytes) of the node's host tier
        async def stat():
            client = KvStoreClient(node.address)
            try:
                return (await client.stat()).tiers[0]
            finally:
                await client.close()
        tier = asyncio.run(stat())
        return tier.blocks, tier.reserved_bytes

    try:
        prefill.start()
        with grpc.insecure_channel(prefill.address) as channel:
            stream = prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id="cancelled", token_ids=tokens, sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=120)
            deadline = time.monotonic() + 60
            while host()[1] == 0:  # one chunk of 16 blocks: its room is reserved at its first layer
                assert time.monotonic() < deadline, "no room was reserved"
                time.sleep(0.02)
            stream.cancel()  # the caller leaves while the prompt computes
        deadline = time.monotonic() + 60
        while prefill.metric("crescent_engine_requests_total", role="prefill", outcome="aborted") == 0:
            assert time.monotonic() < deadline, "the call did not end"
            time.sleep(0.1)
        with grpc.insecure_channel(prefill.address) as channel:  # queued behind the forward in progress
            list(prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id="after", token_ids=tokens[:10], sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=120))
        while host() != (0, 0):
            assert time.monotonic() < deadline, f"the node holds {host()} (blocks, reserved bytes)"
            time.sleep(0.05)
        assert host() == (0, 0)  # no block, and the room went back
        assert prefill.metric(MOVER, mover="shm-layers", direction="put") == 0
    finally:
        prefill.stop()
        scheduler.stop()
