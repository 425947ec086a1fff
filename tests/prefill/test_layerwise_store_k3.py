"""Layer-wise kvstore export of the hybrid kimi_k3 cache into a real kvstore node's pool.

What a user would notice: the blocks read back are byte for byte those the whole-block export
after the prompt stores — latents token-major, with a state exactly where that export puts one
(a snapshot the pool still keeps, the live state of a full last block), whatever the snapshot
pool evicted while the prompt computed, in fp32 and bf16 caches, with a cached prefix; a block
whose state cannot be had in time goes whole, never stored without or with a wrong state; a
prompt stopped midway leaves nothing and gives its room back; a node without a shared pool gets
each block whole (over the TCP side channel) as soon as it is final; beside a layer-wise handoff
the latents are copied out of the cache once, by the handoff. (Real processes: ``test_layerwise_store_k3_process.py``.)
"""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from crescent.protos import decode_pb2
from crescent.services.engine.engine import Engine
from crescent.services.instance.wire import kv_dtype
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.prefill.layerwise import LayerwiseHandoff, supports_layerwise
from crescent.services.prefill.layerwise_store import LayerwiseStoreExport as HybridLayerwiseStoreExport
from crescent.services.prefill.layerwise_store import stores_layerwise
from crescent.services.prefill.prompt_export import PromptExport, owned_bytes
from tests.engine.test_kimi_k3_snapshots import BF16_CFG, PAGE, TEST_CFG, make_engine, prompt
from tests.kvstore.conftest import kvstore_node  # noqa: F401  (the fixture)

MIB = 1 << 20


def whole_blocks(engine: Engine, seq) -> dict[bytes, KvBlock]:  # noqa: ANN001
    """What the whole-block export after the prompt stores (``PrefillServicer._export_new_blocks``)."""
    keys, out = seq.block_keys, {}
    for i in range(len(keys)):
        payload = engine.block_payload(seq, i, PAGE)
        out[keys[i]] = KvBlock.build(keys[i], keys[i - 1] if i else None, engine.model_id, kv_dtype(engine.cache),
                                     tuple(payload.shape), seq.token_ids[i * PAGE : (i + 1) * PAGE], owned_bytes(payload))
    return out


def export(engine: Engine, address: str, tokens: list[int], *, before_layer=None, stop_at: int | None = None,  # noqa: ANN001
           paced: bool = True, beside_handoff: bool = False):
    """Prefill ``tokens`` on a thread with a ``HybridLayerwiseStoreExport`` fed by its layer hook;
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
        layered = HybridLayerwiseStoreExport(engine, seq, seq.num_computed, client, source=source)
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
        whole = whole_blocks(engine, seq)
        await client.close()
        engine.release(seq)
        return layered, left, got, whole, stat
    return asyncio.run(main())


def carries_state(engine: Engine, block: KvBlock) -> bool:
    return engine.cache.payload_has_state(tuple(block.shape))


def test_the_predicate_takes_the_k3_cache_to_its_own_export() -> None:
    engine = make_engine()
    assert stores_layerwise(engine) and not supports_layerwise(engine)


@pytest.mark.parametrize(("cfg", "blocks", "extra", "slots", "chunk"), [
    (TEST_CFG, 13, 5, 3, 4 * PAGE),   # 4 forwards; the pool of 3 evicts most snapshots on the way
    (TEST_CFG, 12, 0, 3, 4 * PAGE),   # a full last block: it carries the live state
    (BF16_CFG, 9, 7, 32, 3 * PAGE),   # every block keeps its snapshot (bf16 latents, fp32 states)
    (TEST_CFG, 6, 3, 32, 2048),       # one forward
], ids=["evicting", "live-state", "bf16", "one-forward"])
@pytest.mark.slow
def test_blocks_read_back_as_the_whole_block_export_stores_them(kvstore_node, cfg, blocks, extra, slots, chunk) -> None:  # noqa: F811, ANN001
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = make_engine(cfg=cfg, slots=slots, chunk=chunk)
    layered, left, got, whole, stat = export(engine, node.address, prompt(blocks * PAGE + extra, seed=blocks))
    assert left == [] and layered.stored == blocks and layered.rejected == 0
    assert {k: (bytes(b.payload), b.to_meta()) for k, b in got.items()} == \
           {k: (bytes(b.payload), b.to_meta()) for k, b in whole.items()}
    # a state where the pool still kept a snapshot at the prompt's end (and the live-state block)
    assert sum(carries_state(engine, b) for b in whole.values()) == min(blocks, slots)
    assert layered.bytes_written == sum(b.nbytes for b in whole.values())
    # in the node before the prompt's last layer was computed: all but that (MLA) layer of the
    # blocks its last forward completes (the others' layers and every state came before)
    n = blocks * PAGE + extra
    last_forward_blocks = blocks - (n - 1) // chunk * chunk // PAGE
    assert layered.bytes_written - layered.bytes_early == last_forward_blocks * engine.cache.layer_layout().layer_bytes(PAGE)
    assert stat.tiers[0].reserved_bytes == 0 and stat.tiers[0].blocks == blocks


@pytest.mark.parametrize(("blocks", "extra", "slots"), [(13, 5, 3), (12, 0, 3)], ids=["evicting", "live-state"])
@pytest.mark.slow
def test_beside_a_handoff_the_latents_are_copied_out_of_the_cache_once(kvstore_node, blocks, extra, slots) -> None:  # noqa: F811, ANN001
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = make_engine(slots=slots, chunk=4 * PAGE)
    layered, left, got, whole, _ = export(engine, node.address, prompt(blocks * PAGE + extra, seed=blocks), beside_handoff=True)
    assert left == [] and layered.stored == blocks
    assert {k: bytes(b.payload) for k, b in got.items()} == {k: bytes(b.payload) for k, b in whole.items()}
    # only the states came out of the cache here; every latent came from the handoff's copy
    states = sum(carries_state(engine, b) for b in whole.values())
    assert layered.bytes_from_cache == states * engine.cache.layer_layout().state_bytes


@pytest.mark.slow
def test_a_cached_prefix_is_not_exported_again(kvstore_node) -> None:  # noqa: F811
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = make_engine(chunk=2 * PAGE)
    first = prompt(5 * PAGE + 3, seed=2)
    export(engine, node.address, first)
    layered, left, got, whole, _ = export(engine, node.address, first[: 4 * PAGE] + prompt(3 * PAGE + 1, seed=3))
    assert layered.first == 4 and layered.stored == 3 and left == []  # resumed from block 4's snapshot
    assert all(bytes(got[k].payload) == bytes(b.payload) for k, b in whole.items())


@pytest.mark.slow
def test_a_block_whose_snapshot_is_gone_before_its_state_is_copied_goes_whole(kvstore_node) -> None:  # noqa: F811
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = make_engine(chunk=2 * PAGE)
    layout = engine.cache.layer_layout()
    tokens = prompt(6 * PAGE + 4, seed=4)

    def lose_block_1s_snapshot(seq, layer: int, end: int) -> None:  # noqa: ANN001 - as an eviction would
        if end == len(tokens) and layer == layout.states_after:
            engine.cache.snapshots.drop(seq.pages[1])

    layered, left, got, whole, _ = export(engine, node.address, tokens, before_layer=lose_block_1s_snapshot)
    assert left == [1] and layered.stored == 5 and seq_key(whole, 1) not in got  # the whole put stores it
    assert not carries_state(engine, whole[seq_key(whole, 1)])  # ... without the state it lost
    assert all(bytes(got[k].payload) == bytes(b.payload) for k, b in whole.items() if k in got)


def seq_key(whole: dict[bytes, KvBlock], i: int) -> bytes:
    return list(whole)[i]


@pytest.mark.slow
def test_a_prompt_stopped_midway_leaves_nothing_and_gives_its_room_back(kvstore_node) -> None:  # noqa: F811
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    engine = make_engine(chunk=2048)
    layout = engine.cache.layer_layout()
    mla = [layer for layer, wire in enumerate(layout.wire_layers) if wire is not None]
    layered, left, got, _, stat = export(engine, node.address, prompt(5 * PAGE, seed=5), stop_at=mla[-1])
    assert layered.bytes_written > 0 and layered.stored == 0  # its first MLA layer landed, then it stopped
    assert left == [] and got == {}
    assert stat.tiers[0].blocks == 0 and stat.tiers[0].reserved_bytes == 0


@pytest.mark.slow
def test_a_node_without_a_shared_pool_gets_each_block_whole_once_final(kvstore_node) -> None:  # noqa: F811
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}, "shared_memory": False})
    engine = make_engine(every=0, chunk=2 * PAGE)  # a snapshot only at the prompt's last full block
    before = {m: mover_bytes(node.address, m) for m in ("shm-layers", "tcp")}
    layered, left, got, whole, stat = export(engine, node.address, prompt(5 * PAGE + 1, seed=6))
    assert left == [] and layered.stored == 5 and stat.tiers[0].reserved_bytes == 0
    assert {k: bytes(b.payload) for k, b in got.items()} == {k: bytes(b.payload) for k, b in whole.items()}
    assert mover_bytes(node.address, "shm-layers") == before["shm-layers"]
    assert mover_bytes(node.address, "tcp") - before["tcp"] == layered.bytes_written == sum(b.nbytes for b in whole.values())
    # blocks 0-3 (latents only) went while later forwards computed; block 4, with its snapshot, after
    assert layered.bytes_early == sum(b.nbytes for b in list(whole.values())[:4])
    assert carries_state(engine, list(whole.values())[4])


def mover_bytes(address: str, mover: str) -> float:
    return REGISTRY.get_sample_value("crescent_kv_mover_bytes_total",
                                     {"peer": address, "mover": mover, "direction": "put"}) or 0.0
