"""Layer-wise kvstore export: a prompt's new blocks go into a real kvstore node's pool a layer at
a time while the prompt computes, and become readable only once whole and checked.

What a user would notice: the blocks read back are byte for byte those a whole-block export
stores; a prompt stopped midway leaves nothing in the store and its reserved room goes back; a
layer damaged on its way is refused at commit and never served; beside a layer-wise handoff, the
export reads the handoff's copies and copies nothing out of the cache itself. (The setting on
and off through a real prefill process: ``test_layerwise_store_process.py``.)
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from prometheus_client import REGISTRY

from crescent.protos import decode_pb2
from crescent.services.engine.engine import Engine
from crescent.services.instance.wire import kv_dtype
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.prefill.layerwise import LayerwiseHandoff
from crescent.services.prefill.layerwise_store import LayerwiseStoreExport
from crescent.services.prefill.prompt_export import PromptExport, owned_bytes
from tests.engine.tiny_model import tiny_model
from tests.kvstore.conftest import kvstore_node  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)

PAGE = 4
MIB = 1 << 20


def make_engine(chunk: int = 8) -> Engine:
    torch.set_num_threads(1)
    return Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=64 * PAGE, block_size=PAGE,
                  prefill_chunk_tokens=chunk)


def whole_blocks(engine: Engine, seq) -> list[KvBlock]:  # noqa: ANN001
    """What the whole-block export after the prompt stores (``PrefillServicer._export_new_blocks``)."""
    keys = seq.block_keys
    return [KvBlock.build(keys[i], keys[i - 1] if i else None, engine.model_id, kv_dtype(engine.cache),
                          engine.cache.payload_shape(PAGE), seq.token_ids[i * PAGE : (i + 1) * PAGE],
                          owned_bytes(engine.block_payload(seq, i, PAGE)))
            for i in range(len(keys))]


def export(engine: Engine, address: str, tokens: list[int], *, hook=None, stop_after_writes: bool = False,  # noqa: ANN001
           wrap=None, paced: bool = False, beside_handoff: bool = False):  # noqa: ANN001
    """Prefill ``tokens`` on a thread with a ``LayerwiseStoreExport`` fed by its layer hook;
    (the sequence, the export, the blocks it left to a whole put, a get of its keys, the node's
    stat, the client). ``hook``: its ``landed``; ``stop_after_writes``: the prompt stops (as a
    cancelled call does) once a layer has landed, before its last layer; ``wrap``: called with the client first;
    ``paced``: the engine waits for each layer to land before computing the next (a slow forward);
    ``beside_handoff``: a layer-wise handoff of the prompt (its stream not started) is the source,
    as ``layered.source``."""
    async def main():
        client = KvStoreClient(address, shared_memory=True)
        if wrap is not None:
            wrap(client)
        seq = engine.add_sequence("s", tokens)
        source = (LayerwiseHandoff(engine, seq, PromptExport(engine, None, seq, len(tokens)), decode_pb2.HandoffHeader())
                  if beside_handoff else None)
        layered = LayerwiseStoreExport(engine, seq, seq.num_computed, client, source=source)
        layered.source = source
        if hook is not None:
            layered.landed = hook
        tasks: list[asyncio.Task] = []
        layered.start(lambda coro: tasks.append(asyncio.create_task(coro)))
        loop = asyncio.get_running_loop()
        stopped = threading.Event()

        def on_layer(layer: int, end: int) -> None:
            if stop_after_writes and layer == layered.num_layers - 1 and not stopped.is_set():
                deadline = time.monotonic() + 10
                while layered.bytes_written == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)  # the loop copies the first layers meanwhile
                loop.call_soon_threadsafe(layered.stop)  # before the last layer is told
                stopped.set()
            layered.on_layer(layer, end)
            deadline = time.monotonic() + 10
            while paced and layered._next_block[layer] < min(end // PAGE, layered.end) and time.monotonic() < deadline:
                time.sleep(0.005)

        await asyncio.to_thread(engine.prefill, seq, on_layer)
        left = await layered.finished()
        await asyncio.gather(*tasks)
        got = await client.get(seq.block_keys, "tiny")
        stat = await client.stat()
        await client.close()
        return seq, layered, left, got, stat, client
    return asyncio.run(main())


def mover_bytes(address: str, mover: str) -> float:
    return REGISTRY.get_sample_value("crescent_kv_mover_bytes_total",
                                     {"peer": address, "mover": mover, "direction": "put"}) or 0.0


def handoff_holds(layered: LayerwiseStoreExport, whole: list[KvBlock]) -> None:
    """The export copied nothing out of the cache: the handoff beside it did, into its buffers."""
    assert layered.bytes_from_cache == 0
    assert [bytes(layered.source.block_view(i)) for i in range(len(whole))] == [bytes(b.payload) for b in whole]


@pytest.mark.parametrize("beside_handoff", [False, True], ids=["alone", "beside-handoff"])
def test_blocks_stream_per_layer_and_read_back_as_a_whole_block_export_stores_them(kvstore_node, beside_handoff) -> None:  # noqa: F811
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = make_engine(chunk=8)
    tokens = [(5 * i + 3) % 97 for i in range(23)]  # 5 full blocks in 3 chunks, and a partial one
    before = mover_bytes(node.address, "shm-layers")
    seq, layered, left, got, stat, client = export(engine, node.address, tokens, paced=True, beside_handoff=beside_handoff)
    assert left == [] and layered.stored == 5 and layered.rejected == 0
    # every layer went in as it was computed: all but the last layer of the last block before the prompt's end
    assert layered.bytes_written == sum(b.nbytes for b in whole_blocks(engine, seq))
    assert layered.bytes_early == layered.bytes_written - layered.bytes_written // 5 // engine.config.num_layers
    for block in whole_blocks(engine, seq):
        stored = got[block.key]
        assert bytes(stored.payload) == bytes(block.payload) and stored.to_meta() == block.to_meta()
    assert stat.tiers[0].reserved_bytes == 0 and stat.tiers[0].blocks == 5
    assert mover_bytes(node.address, "shm-layers") - before == layered.bytes_written
    assert not client.errors
    if beside_handoff:
        handoff_holds(layered, whole_blocks(engine, seq))
    else:
        assert layered.bytes_from_cache == layered.bytes_written


def test_a_prompt_stopped_midway_leaves_nothing_and_gives_its_room_back(kvstore_node) -> None:  # noqa: F811
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = make_engine(chunk=16)
    tokens = [(3 * i + 1) % 97 for i in range(16)]  # one chunk: its 4 blocks are whole only at its last layer
    reserves = []

    def count_reserves(client: KvStoreClient) -> None:
        reserve = client._stub.ReserveShm

        async def counted(request, **kwargs):  # noqa: ANN001, ANN003
            reply = await reserve(request, **kwargs)
            reserves.append(sum(slot.granted for slot in reply.slots))
            return reply

        client._stub.ReserveShm = counted

    _, layered, left, got, stat, _ = export(engine, node.address, tokens, stop_after_writes=True, wrap=count_reserves)
    assert reserves == [4] and layered.bytes_written > 0  # room was granted and written into
    assert left == [] and layered.stored == 0 and got == {}
    host = stat.tiers[0]
    assert host.blocks == 0 and host.bytes == 0 and host.reserved_bytes == 0


def test_a_damaged_layer_is_refused_at_commit_and_never_served(kvstore_node) -> None:  # noqa: F811
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = make_engine(chunk=8)
    tokens = [(7 * i + 2) % 97 for i in range(16)]

    def damage(block: int, layer: int, room: memoryview) -> None:  # after its CRC was taken, as a stray write
        if block == 1 and layer == 1:
            room[5] ^= 0xFF

    seq, layered, left, got, stat, _ = export(engine, node.address, tokens, hook=damage)
    assert layered.stored == 3 and layered.rejected == 1 and left == []
    assert seq.block_keys[1] not in got and all(seq.block_keys[i] in got for i in (0, 2, 3))
    assert node.metric("crescent_kvstore_checksum_failures_total", tier="put") == 1  # refused on arrival
    assert stat.tiers[0].blocks == 3 and stat.tiers[0].reserved_bytes == 0


def test_blocks_the_node_holds_are_not_sent_again(kvstore_node) -> None:  # noqa: F811
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    tokens = [(11 * i + 5) % 97 for i in range(16)]
    export(make_engine(), node.address, tokens)
    _, layered, left, got, stat, _ = export(make_engine(), node.address, tokens)  # a fresh engine: a cold prompt again
    assert layered.bytes_written == 0 and left == [] and len(got) == 4 and stat.tiers[0].blocks == 4


@pytest.mark.parametrize("beside_handoff", [False, True], ids=["alone", "beside-handoff"])
def test_a_node_without_a_shared_pool_gets_each_chunk_s_blocks_whole_while_the_next_computes(kvstore_node, beside_handoff) -> None:  # noqa: F811
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}, "shared_memory": False})
    before = {m: mover_bytes(node.address, m) for m in ("shm-layers", "tcp")}
    engine = make_engine(chunk=8)
    tokens = [(13 * i) % 97 for i in range(23)]  # 5 full blocks in 3 chunks
    seq, layered, left, got, _, client = export(engine, node.address, tokens, paced=True, beside_handoff=beside_handoff)
    assert not client.takes_layers  # asked once: whole puts (the TCP side channel here) from then on
    assert left == [] and layered.stored == 5
    whole = whole_blocks(engine, seq)
    assert [bytes(got[b.key].payload) for b in whole] == [bytes(b.payload) for b in whole]
    assert mover_bytes(node.address, "shm-layers") == before["shm-layers"]
    assert mover_bytes(node.address, "tcp") - before["tcp"] == layered.bytes_written == sum(b.nbytes for b in whole)
    # the first two chunks' blocks went while later chunks computed; the last chunk's after
    assert layered.bytes_early == 4 * whole[0].nbytes
    if beside_handoff:  # the blocks put were the handoff's buffers themselves
        handoff_holds(layered, whole)


def test_room_held_too_long_is_given_back_and_its_blocks_left_to_the_whole_put(kvstore_node) -> None:  # noqa: F811
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}, "layer_reservation_ms": 200})

    def slow(block: int, layer: int, room: memoryview) -> None:  # a chunk's forward outlasting half the room's life
        if block == 0 and layer == 0:
            time.sleep(0.15)

    _, layered, left, got, stat, _ = export(make_engine(chunk=16), node.address, [(17 * i) % 97 for i in range(16)], hook=slow)
    assert left == [0, 1, 2, 3] and layered.stored == 0 and got == {}
    assert stat.tiers[0].reserved_bytes == 0 and stat.tiers[0].blocks == 0
