"""Layer-wise kvstore export in one process, both model families: a prompt's new blocks go into a
real kvstore node's pool a layer at a time while the prompt computes, and become readable only
once whole and checked.

What a user would notice: the blocks read back are byte for byte those the whole-block export
after the prompt stores (kimi_k3: latents token-major, with a state exactly where that export puts
one — a snapshot the pool still keeps, the live state of a full last block — whatever the pool
evicted meanwhile, in fp32 and bf16 caches, with a cached prefix; a block whose state cannot be
had in time goes whole); a prompt stopped midway leaves nothing in the store and its reserved
room goes back; a layer damaged on its way is refused at commit and never served; blocks the
node holds are not sent again; a node without a shared pool gets each block whole (over the TCP
side channel) as soon as it is final; beside a layer-wise handoff, the export reads the
handoff's copies and copies nothing out of the cache itself. (Real prefill processes, the
setting on and off: ``test_processes.py``.)
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from crescent.protos import decode_pb2
from crescent.services.engine.engine import Engine
from crescent.services.instance.wire import kv_dtype
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.prefill.layerwise import LayerwiseHandoff
from crescent.services.prefill.layerwise_store import LayerwiseStoreExport
from crescent.services.prefill.prompt_export import PromptExport, owned_bytes
from tests.dataplane.families import K3_PAGE, LLAMA_PAGE, MIB, llama_engine, mover_bytes
from tests.engine import test_kimi_k3_snapshots as k3

pytestmark = pytest.mark.slow  # every test starts a kvstore node process: `make test-fast` leaves them out


# ---- llama --------------------------------------------------------------------------------------------

def llama_whole_blocks(engine: Engine, seq) -> list[KvBlock]:  # noqa: ANN001
    """What the whole-block export after the prompt stores (``PrefillServicer._export_new_blocks``)."""
    keys = seq.block_keys
    return [KvBlock.build(keys[i], keys[i - 1] if i else None, engine.model_id, kv_dtype(engine.cache),
                          engine.cache.payload_shape(LLAMA_PAGE), seq.token_ids[i * LLAMA_PAGE : (i + 1) * LLAMA_PAGE],
                          owned_bytes(engine.block_payload(seq, i, LLAMA_PAGE)))
            for i in range(len(keys))]


def export_llama(engine: Engine, address: str, tokens: list[int], *, hook=None, stop_after_writes: bool = False,  # noqa: ANN001
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
            while paced and layered._next_block[layer] < min(end // LLAMA_PAGE, layered.end) and time.monotonic() < deadline:
                time.sleep(0.005)

        await asyncio.to_thread(engine.prefill, seq, on_layer)
        left = await layered.finished()
        await asyncio.gather(*tasks)
        got = await client.get(seq.block_keys, "tiny")
        stat = await client.stat()
        await client.close()
        return seq, layered, left, got, stat, client
    return asyncio.run(main())


def handoff_holds(layered: LayerwiseStoreExport, whole: list[KvBlock]) -> None:
    """The export copied nothing out of the cache: the handoff beside it did, into its buffers."""
    assert layered.bytes_from_cache == 0
    assert [bytes(layered.source.block_view(i)) for i in range(len(whole))] == [bytes(b.payload) for b in whole]


@pytest.mark.parametrize("beside_handoff", [False, True], ids=["alone", "beside-handoff"])
def test_llama_blocks_stream_per_layer_and_read_back_as_a_whole_block_export_stores_them(kvstore_node, beside_handoff) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = llama_engine(chunk=8)
    tokens = [(5 * i + 3) % 97 for i in range(23)]  # 5 full blocks in 3 chunks, and a partial one
    before = mover_bytes(node.address, "shm-layers")
    seq, layered, left, got, stat, client = export_llama(engine, node.address, tokens, paced=True, beside_handoff=beside_handoff)
    assert left == [] and layered.stored == 5 and layered.rejected == 0
    # every layer went in as it was computed: all but the last layer of the last block before the prompt's end
    assert layered.bytes_written == sum(b.nbytes for b in llama_whole_blocks(engine, seq))
    assert layered.bytes_early == layered.bytes_written - layered.bytes_written // 5 // engine.config.num_layers
    for block in llama_whole_blocks(engine, seq):
        stored = got[block.key]
        assert bytes(stored.payload) == bytes(block.payload) and stored.to_meta() == block.to_meta()
    assert stat.tiers[0].reserved_bytes == 0 and stat.tiers[0].blocks == 5
    assert mover_bytes(node.address, "shm-layers") - before == layered.bytes_written
    assert not client.errors
    if beside_handoff:
        handoff_holds(layered, llama_whole_blocks(engine, seq))
    else:
        assert layered.bytes_from_cache == layered.bytes_written


def test_a_llama_prompt_stopped_midway_leaves_nothing_and_gives_its_room_back(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = llama_engine(chunk=16)
    tokens = [(3 * i + 1) % 97 for i in range(16)]  # one chunk: its 4 blocks are whole only at its last layer
    reserves = []

    def count_reserves(client: KvStoreClient) -> None:
        reserve = client._stub.ReserveShm

        async def counted(request, **kwargs):  # noqa: ANN001, ANN003
            reply = await reserve(request, **kwargs)
            reserves.append(sum(slot.granted for slot in reply.slots))
            return reply

        client._stub.ReserveShm = counted

    _, layered, left, got, stat, _ = export_llama(engine, node.address, tokens, stop_after_writes=True, wrap=count_reserves)
    assert reserves == [4] and layered.bytes_written > 0  # room was granted and written into
    assert left == [] and layered.stored == 0 and got == {}
    host = stat.tiers[0]
    assert host.blocks == 0 and host.bytes == 0 and host.reserved_bytes == 0


def test_a_damaged_llama_layer_is_refused_at_commit_and_never_served(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = llama_engine(chunk=8)
    tokens = [(7 * i + 2) % 97 for i in range(16)]

    def damage(block: int, layer: int, room: memoryview) -> None:  # after its CRC was taken, as a stray write
        if block == 1 and layer == 1:
            room[5] ^= 0xFF

    seq, layered, left, got, stat, _ = export_llama(engine, node.address, tokens, hook=damage)
    assert layered.stored == 3 and layered.rejected == 1 and left == []
    assert seq.block_keys[1] not in got and all(seq.block_keys[i] in got for i in (0, 2, 3))
    assert node.metric("crescent_kvstore_checksum_failures_total", tier="put") == 1  # refused on arrival
    assert stat.tiers[0].blocks == 3 and stat.tiers[0].reserved_bytes == 0


def test_llama_blocks_the_node_holds_are_not_sent_again(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    tokens = [(11 * i + 5) % 97 for i in range(16)]
    export_llama(llama_engine(), node.address, tokens)
    _, layered, left, got, stat, _ = export_llama(llama_engine(), node.address, tokens)  # a fresh engine: a cold prompt again
    assert layered.bytes_written == 0 and left == [] and len(got) == 4 and stat.tiers[0].blocks == 4


@pytest.mark.parametrize("beside_handoff", [False, True], ids=["alone", "beside-handoff"])
def test_a_node_without_a_shared_pool_gets_each_llama_chunk_s_blocks_whole_while_the_next_computes(kvstore_node, beside_handoff) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}, "shared_memory": False})
    before = {m: mover_bytes(node.address, m) for m in ("shm-layers", "tcp")}
    engine = llama_engine(chunk=8)
    tokens = [(13 * i) % 97 for i in range(23)]  # 5 full blocks in 3 chunks
    seq, layered, left, got, _, client = export_llama(engine, node.address, tokens, paced=True, beside_handoff=beside_handoff)
    assert not client.takes_layers  # asked once: whole puts (the TCP side channel here) from then on
    assert left == [] and layered.stored == 5
    whole = llama_whole_blocks(engine, seq)
    assert [bytes(got[b.key].payload) for b in whole] == [bytes(b.payload) for b in whole]
    assert mover_bytes(node.address, "shm-layers") == before["shm-layers"]
    assert mover_bytes(node.address, "tcp") - before["tcp"] == layered.bytes_written == sum(b.nbytes for b in whole)
    # the first two chunks' blocks went while later chunks computed; the last chunk's after
    assert layered.bytes_early == 4 * whole[0].nbytes
    if beside_handoff:  # the blocks put were the handoff's buffers themselves
        handoff_holds(layered, whole)


def test_llama_room_held_too_long_is_given_back_and_its_blocks_left_to_the_whole_put(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}, "layer_reservation_ms": 200})

    def slow(block: int, layer: int, room: memoryview) -> None:  # a chunk's forward outlasting half the room's life
        if block == 0 and layer == 0:
            time.sleep(0.15)

    _, layered, left, got, stat, _ = export_llama(llama_engine(chunk=16), node.address, [(17 * i) % 97 for i in range(16)], hook=slow)
    assert left == [0, 1, 2, 3] and layered.stored == 0 and got == {}
    assert stat.tiers[0].reserved_bytes == 0 and stat.tiers[0].blocks == 0


# ---- kimi_k3 ------------------------------------------------------------------------------------------

def k3_whole_blocks(engine: Engine, seq) -> dict[bytes, KvBlock]:  # noqa: ANN001
    """What the whole-block export after the prompt stores (``PrefillServicer._export_new_blocks``)."""
    keys, out = seq.block_keys, {}
    for i in range(len(keys)):
        payload = engine.block_payload(seq, i, K3_PAGE)
        out[keys[i]] = KvBlock.build(keys[i], keys[i - 1] if i else None, engine.model_id, kv_dtype(engine.cache),
                                     tuple(payload.shape), seq.token_ids[i * K3_PAGE : (i + 1) * K3_PAGE], owned_bytes(payload))
    return out


def export_k3(engine: Engine, address: str, tokens: list[int], *, before_layer=None, stop_at: int | None = None,  # noqa: ANN001
           paced: bool = True, beside_handoff: bool = False):
    """Prefill ``tokens`` on a thread with a ``LayerwiseStoreExport`` fed by its layer hook;
    (the export, the blocks it left to a whole put, a get of the prompt's keys, the whole-block
    export's blocks, the node's stat). ``before_layer(seq, layer, end)`` runs in the hook first;
    ``stop_at``: the prompt stops (as a cancelled call does) at that layer of its last forward;
    ``paced``: the engine waits for each event to be acted on before computing on (a slow forward);
    ``beside_handoff``: a layer-wise handoff of the prompt (its stream not started) is the source."""
    async def main():
        client = KvStoreClient(address, shared_memory=True)
        seq = engine.add_sequence("s", tokens)
        source = (LayerwiseHandoff(engine, seq, PromptExport(engine, None, seq, len(tokens)), decode_pb2.HandoffHeader())
                  if beside_handoff else None)
        layered = LayerwiseStoreExport(engine, seq, seq.num_computed, client, source=source)
        tasks: list[asyncio.Task] = []
        layered.start(lambda coro: tasks.append(asyncio.create_task(coro)))
        loop = asyncio.get_running_loop()

        def on_layer(layer: int, end: int) -> None:
            if before_layer is not None:
                before_layer(seq, layer, end)
            if stop_at == layer and end == len(tokens):
                asyncio.run_coroutine_threadsafe(layered.close(), loop).result()
            layered.on_layer(layer, end)
            posted[0] += (layer == 0) + (layout.wire_layers[layer] is not None) + (
                end == len(tokens) and layer == layout.states_after)
            deadline = time.monotonic() + 10
            while paced and layered.events_handled < posted[0] and time.monotonic() < deadline:
                time.sleep(0.002)

        layout, posted = engine.cache.layer_layout(), [0]
        await asyncio.to_thread(engine.prefill, seq, on_layer)
        left = await layered.finished()
        await asyncio.gather(*tasks)
        got = await client.get(seq.block_keys, engine.model_id)
        stat = await client.stat()
        whole = k3_whole_blocks(engine, seq)
        await client.close()
        engine.release(seq)
        return layered, left, got, whole, stat
    return asyncio.run(main())


def carries_state(engine: Engine, block: KvBlock) -> bool:
    return engine.cache.payload_has_state(tuple(block.shape))


@pytest.mark.parametrize(("cfg", "blocks", "extra", "slots", "chunk"), [
    (k3.TEST_CFG, 13, 5, 3, 4 * K3_PAGE),   # 4 forwards; the pool of 3 evicts most snapshots on the way
    (k3.TEST_CFG, 12, 0, 3, 4 * K3_PAGE),   # a full last block: it carries the live state
    (k3.BF16_CFG, 9, 7, 32, 3 * K3_PAGE),   # every block keeps its snapshot (bf16 latents, fp32 states)
    (k3.TEST_CFG, 6, 3, 32, 2048),       # one forward
], ids=["evicting", "live-state", "bf16", "one-forward"])
def test_k3_blocks_read_back_as_the_whole_block_export_stores_them(kvstore_node, cfg, blocks, extra, slots, chunk) -> None:  # noqa: ANN001
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = k3.make_engine(cfg=cfg, slots=slots, chunk=chunk)
    layered, left, got, whole, stat = export_k3(engine, node.address, k3.prompt(blocks * K3_PAGE + extra, seed=blocks))
    assert left == [] and layered.stored == blocks and layered.rejected == 0
    assert {k: (bytes(b.payload), b.to_meta()) for k, b in got.items()} == \
           {k: (bytes(b.payload), b.to_meta()) for k, b in whole.items()}
    # a state where the pool still kept a snapshot at the prompt's end (and the live-state block)
    assert sum(carries_state(engine, b) for b in whole.values()) == min(blocks, slots)
    assert layered.bytes_written == sum(b.nbytes for b in whole.values())
    # in the node before the prompt's last layer was computed: all but that (MLA) layer of the
    # blocks its last forward completes (the others' layers and every state came before)
    n = blocks * K3_PAGE + extra
    last_forward_blocks = blocks - (n - 1) // chunk * chunk // K3_PAGE
    assert layered.bytes_written - layered.bytes_early == last_forward_blocks * engine.cache.layer_layout().layer_bytes(K3_PAGE)
    assert stat.tiers[0].reserved_bytes == 0 and stat.tiers[0].blocks == blocks


@pytest.mark.parametrize(("blocks", "extra", "slots"), [(13, 5, 3), (12, 0, 3)], ids=["evicting", "live-state"])
def test_beside_a_handoff_the_k3_latents_are_copied_out_of_the_cache_once(kvstore_node, blocks, extra, slots) -> None:  # noqa: ANN001
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = k3.make_engine(slots=slots, chunk=4 * K3_PAGE)
    layered, left, got, whole, _ = export_k3(engine, node.address, k3.prompt(blocks * K3_PAGE + extra, seed=blocks), beside_handoff=True)
    assert left == [] and layered.stored == blocks
    assert {k: bytes(b.payload) for k, b in got.items()} == {k: bytes(b.payload) for k, b in whole.items()}
    # only the states came out of the cache here; every latent came from the handoff's copy
    states = sum(carries_state(engine, b) for b in whole.values())
    assert layered.bytes_from_cache == states * engine.cache.layer_layout().state_bytes


def test_a_cached_k3_prefix_is_not_exported_again(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = k3.make_engine(chunk=2 * K3_PAGE)
    first = k3.prompt(5 * K3_PAGE + 3, seed=2)
    export_k3(engine, node.address, first)
    layered, left, got, whole, _ = export_k3(engine, node.address, first[: 4 * K3_PAGE] + k3.prompt(3 * K3_PAGE + 1, seed=3))
    assert layered.first == 4 and layered.stored == 3 and left == []  # resumed from block 4's snapshot
    assert all(bytes(got[k].payload) == bytes(b.payload) for k, b in whole.items())


def test_a_block_whose_snapshot_is_gone_before_its_state_is_copied_goes_whole(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = k3.make_engine(chunk=2 * K3_PAGE)
    layout = engine.cache.layer_layout()
    tokens = k3.prompt(6 * K3_PAGE + 4, seed=4)

    def lose_block_1s_snapshot(seq, layer: int, end: int) -> None:  # noqa: ANN001 - as an eviction would
        if end == len(tokens) and layer == layout.states_after:
            engine.cache.snapshots.drop(seq.pages[1])

    layered, left, got, whole, _ = export_k3(engine, node.address, tokens, before_layer=lose_block_1s_snapshot)
    assert left == [1] and layered.stored == 5 and seq_key(whole, 1) not in got  # the whole put stores it
    assert not carries_state(engine, whole[seq_key(whole, 1)])  # ... without the state it lost
    assert all(bytes(got[k].payload) == bytes(b.payload) for k, b in whole.items() if k in got)


def seq_key(whole: dict[bytes, KvBlock], i: int) -> bytes:
    return list(whole)[i]


def test_a_k3_prompt_stopped_midway_leaves_nothing_and_gives_its_room_back(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = k3.make_engine(chunk=2048)
    layout = engine.cache.layer_layout()
    mla = [layer for layer, wire in enumerate(layout.wire_layers) if wire is not None]
    layered, left, got, _, stat = export_k3(engine, node.address, k3.prompt(5 * K3_PAGE, seed=5), stop_at=mla[-1])
    assert layered.bytes_written > 0 and layered.stored == 0  # its first MLA layer landed, then it stopped
    assert left == [] and got == {}
    assert stat.tiers[0].blocks == 0 and stat.tiers[0].reserved_bytes == 0


def test_a_node_without_a_shared_pool_gets_each_k3_block_whole_once_final(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}, "shared_memory": False})
    engine = k3.make_engine(every=0, chunk=2 * K3_PAGE)  # a snapshot only at the prompt's last full block
    before = {m: mover_bytes(node.address, m) for m in ("shm-layers", "tcp")}
    layered, left, got, whole, stat = export_k3(engine, node.address, k3.prompt(5 * K3_PAGE + 1, seed=6))
    assert left == [] and layered.stored == 5 and stat.tiers[0].reserved_bytes == 0
    assert {k: bytes(b.payload) for k, b in got.items()} == {k: bytes(b.payload) for k, b in whole.items()}
    assert mover_bytes(node.address, "shm-layers") == before["shm-layers"]
    assert mover_bytes(node.address, "tcp") - before["tcp"] == layered.bytes_written == sum(b.nbytes for b in whole.values())
    # blocks 0-3 (latents only) went while later forwards computed; block 4, with its snapshot, after
    assert layered.bytes_early == sum(b.nbytes for b in list(whole.values())[:4])
    assert carries_state(engine, list(whole.values())[4])
