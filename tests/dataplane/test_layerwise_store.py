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
handoff's copies and copies nothing out of the cache itself but the states. (Real prefill
processes, the setting on and off: ``test_processes.py``.)

The checks both families share are one test over ``families.FAMILIES`` (one export helper, one
whole-block reference, one pacing rule: the engine waits for the export's ``events_handled``);
what only one family has (llama's damaged layer, its room held too long, blocks not sent again;
kimi_k3's snapshots, cached prefix and lost snapshot) keeps a test of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from crescent.protos import decode_pb2
from crescent.services.engine.cache_api import StatefulKvCache
from crescent.services.engine.engine import Engine, Sequence
from crescent.services.instance.wire import kv_dtype
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.prefill.layerwise import LayerwiseHandoff
from crescent.services.prefill.layerwise_store import LayerwiseStoreExport
from crescent.services.prefill.prompt_export import PromptExport, owned_bytes
from tests.dataplane.families import K3, LLAMA, MIB, Family, k3_engine, mover_bytes
from tests.engine import test_kimi_k3_snapshots as k3

pytestmark = pytest.mark.slow  # every test starts a kvstore node process: `make test-fast` leaves them out

POOL = {"tiers": {"host": {"capacity_bytes": 16 * MIB}}}
NO_SHARED_POOL = {**POOL, "shared_memory": False}


def whole_blocks(engine: Engine, seq: Sequence) -> list[KvBlock]:
    """What the whole-block export after the prompt stores (``pipeline._export_new_blocks``): each
    full block's payload as ``Engine.block_payload`` gives it (kimi_k3: with a state or without)."""
    keys, page = seq.block_keys, engine.block_size
    out = []
    for i in range(len(keys)):
        payload = engine.block_payload(seq, i, page)
        out.append(KvBlock.build(keys[i], keys[i - 1] if i else None, engine.model_id, kv_dtype(engine.cache),
                                 tuple(payload.shape), seq.token_ids[i * page : (i + 1) * page], owned_bytes(payload)))
    return out


@dataclass
class Exported:
    """A prompt exported layer-wise into a node, and what the node then holds."""

    seq: Sequence
    layered: LayerwiseStoreExport
    left: list[int]              # the blocks it left to the whole put after the prompt
    got: dict[bytes, KvBlock]    # a get of the prompt's keys
    whole: list[KvBlock]         # the whole-block export's blocks (the reference)
    stat: Any                    # the node's stat
    client: KvStoreClient
    reserves: list[int]          # blocks granted room, per reservation

    def states(self, engine: Engine) -> int:
        """How many of the whole-block export's blocks carry a state (kimi_k3)."""
        return sum(carries_state(engine, b) for b in self.whole)


def last_kv_layer(engine: Engine) -> int:
    """The hook index of the model's last layer with per-token KV (llama: its last layer; kimi_k3:
    its last MLA layer)."""
    return max(layer for layer, wire in enumerate(engine.cache.layer_layout().wire_layers) if wire is not None)


def export(engine: Engine, address: str, tokens: list[int], *, paced: bool = True, beside_handoff: bool = False,
           stop_at: int | None = None, before_layer: Callable[..., None] | None = None,
           landed: Callable[[int, int, memoryview], None] | None = None) -> Exported:
    """Prefill ``tokens`` on a thread with a ``LayerwiseStoreExport`` fed by its layer hook.
    ``paced``: the engine waits for each hook event to be acted on before computing on (a slow
    forward); ``beside_handoff``: a layer-wise handoff of the prompt (its stream not started) is
    the source, as ``layered.source``; ``stop_at``: the prompt stops (as a cancelled call does)
    at that hook layer of its last forward, before the layer is told; ``before_layer(seq, layer,
    end)`` runs in the hook first; ``landed``: the export's ``landed`` (a layer-major layer in
    its room, CRC taken)."""
    async def main() -> Exported:
        client = KvStoreClient(address, shared_memory=True)
        reserves: list[int] = []  # blocks granted room, per reservation (what the node answered)
        reserve = client._stub.ReserveShm

        async def counted(request, **kwargs):  # noqa: ANN001, ANN003, ANN202
            reply = await reserve(request, **kwargs)
            reserves.append(sum(slot.granted for slot in reply.slots))
            return reply

        client._stub.ReserveShm = counted
        seq = engine.add_sequence("s", tokens)
        source = None
        if beside_handoff:
            whole_export = PromptExport(engine, None, seq, len(tokens))
            source = LayerwiseHandoff(engine, seq, whole_export, decode_pb2.HandoffHeader())
        layered = LayerwiseStoreExport(engine, seq, seq.num_computed, client, source=source)
        layered.source = source
        if landed is not None:
            layered.landed = landed
        tasks: list[asyncio.Task] = []
        layered.start(lambda coro: tasks.append(asyncio.create_task(coro)))
        loop = asyncio.get_running_loop()
        layout, posted, stopped = engine.cache.layer_layout(), [0], [False]

        def on_layer(layer: int, end: int) -> None:
            if before_layer is not None:
                before_layer(seq, layer, end)
            if stop_at == layer and end == len(tokens):
                asyncio.run_coroutine_threadsafe(layered.close(), loop).result()
                stopped[0] = True
            layered.on_layer(layer, end)
            # the events ``on_layer`` posts: a forward's plan, a layer with KV, the last forward's states
            posted[0] += (layer == 0) + (layout.wire_layers[layer] is not None) + (
                end == len(tokens) and layer == layout.states_after)
            deadline = time.monotonic() + 10
            while paced and not stopped[0] and layered.events_handled < posted[0] and time.monotonic() < deadline:
                time.sleep(0.002)

        await asyncio.to_thread(engine.prefill, seq, on_layer)
        left = await layered.finished()
        await asyncio.gather(*tasks)
        got = await client.get(seq.block_keys, engine.model_id)
        stat = await client.stat()
        whole = whole_blocks(engine, seq)
        await client.close()
        engine.release(seq)
        return Exported(seq, layered, left, got, whole, stat, client, reserves)
    return asyncio.run(main())


def carries_state(engine: Engine, block: KvBlock) -> bool:
    """Whether ``block``'s payload holds a recurrent state (never, in a cache without states)."""
    return isinstance(engine.cache, StatefulKvCache) and engine.cache.payload_has_state(tuple(block.shape))


def payloads_and_metas(blocks: dict[bytes, KvBlock] | list[KvBlock]) -> dict[bytes, tuple[bytes, Any]]:
    items = blocks.items() if isinstance(blocks, dict) else ((b.key, b) for b in blocks)
    return {k: (bytes(b.payload), b.to_meta()) for k, b in items}


def copied_only_the_states(engine: Engine, family: Family, out: Exported) -> None:
    """Beside a handoff the export copied nothing out of the cache but the states (none for
    llama): every layer came from the handoff's copy (llama: a block put whole is its buffer)."""
    assert out.layered.bytes_from_cache == out.states(engine) * engine.cache.layer_layout().state_bytes
    if not family.stateful:  # layer-major: the handoff's buffer is the very payload
        source = out.layered.source
        assert [bytes(source.block_view(i)) for i in range(len(out.whole))] == [bytes(b.payload) for b in out.whole]


# ---- both families ------------------------------------------------------------------------------

# (family, engine factory, full blocks, tokens past them, chunk in pages (None: one forward), snapshot
# slots, beside a handoff). llama: 5 full blocks and 3 tokens in 3 chunks; kimi_k3: a pool of 3
# evicting most snapshots on the way, a full last block (its live state), bf16 latents (fp32
# states), one forward.
READ_BACK = [
    pytest.param(LLAMA, LLAMA.make_engine, 5, 3, 2, None, False, id="llama-alone"),
    pytest.param(LLAMA, LLAMA.make_engine, 5, 3, 2, None, True, id="llama-beside-handoff"),
    pytest.param(K3, k3_engine, 13, 5, 4, 3, False, id="k3-evicting"),
    pytest.param(K3, k3_engine, 12, 0, 4, 3, False, id="k3-live-state"),
    pytest.param(K3, lambda **kw: k3_engine(k3.BF16_CFG, **kw), 9, 7, 3, 32, False, id="k3-bf16"),
    pytest.param(K3, k3_engine, 6, 3, None, 32, False, id="k3-one-forward"),
    pytest.param(K3, k3_engine, 13, 5, 4, 3, True, id="k3-evicting-beside-handoff"),
    pytest.param(K3, k3_engine, 12, 0, 4, 3, True, id="k3-live-state-beside-handoff"),
]


@pytest.mark.parametrize(("family", "make", "blocks", "extra", "chunk_pages", "slots", "beside_handoff"), READ_BACK)
def test_blocks_stream_per_layer_and_read_back_as_the_whole_block_export_stores_them(
        kvstore_node, family, make, blocks, extra, chunk_pages, slots, beside_handoff) -> None:  # noqa: ANN001
    node = kvstore_node(POOL)
    page = family.page
    chunk = 2048 if chunk_pages is None else chunk_pages * page
    engine = make(chunk=chunk, **({"slots": slots} if family.stateful else {}))
    n = blocks * page + extra
    before = mover_bytes(node.address, "shm-layers")
    out = export(engine, node.address, family.prompt(n, blocks), beside_handoff=beside_handoff)
    layered, whole = out.layered, out.whole
    assert out.left == [] and layered.stored == blocks and layered.rejected == 0
    assert payloads_and_metas(out.got) == payloads_and_metas(whole)
    if not family.stateful:  # the llama cache's payload shape, every block
        assert all(tuple(b.shape) == engine.cache.payload_shape(page) for b in whole)
    # kimi_k3: a state where the pool still kept a snapshot at the prompt's end (and the live-state block)
    assert out.states(engine) == (min(blocks, slots) if family.stateful else 0)
    assert layered.bytes_written == sum(b.nbytes for b in whole)
    # every layer went in as it was computed: in the node before the prompt's last layer was
    # computed, all but that layer of the blocks the last forward completes (the others' layers
    # and every state came before)
    last_forward_blocks = blocks - (n - 1) // chunk * chunk // page
    last_layer = engine.cache.layer_layout().layer_bytes(page)
    assert layered.bytes_written - layered.bytes_early == last_forward_blocks * last_layer
    assert out.stat.tiers[0].reserved_bytes == 0 and out.stat.tiers[0].blocks == blocks
    assert mover_bytes(node.address, "shm-layers") - before == layered.bytes_written
    assert not out.client.errors
    if beside_handoff:
        copied_only_the_states(engine, family, out)
    else:
        assert layered.bytes_from_cache == layered.bytes_written


# (family, full blocks): one forward, whose blocks are whole only at its last layer with KV
@pytest.mark.parametrize(("family", "blocks"), [(LLAMA, 4), (K3, 5)], ids=str)
def test_a_prompt_stopped_midway_leaves_nothing_and_gives_its_room_back(
        kvstore_node, family, blocks) -> None:  # noqa: ANN001
    node = kvstore_node(POOL)
    engine = family.make_engine(chunk=2048)
    out = export(engine, node.address, family.prompt(blocks * family.page, 5), stop_at=last_kv_layer(engine))
    assert out.reserves == [blocks] and out.layered.bytes_written > 0  # room was granted and written into
    assert out.layered.stored == 0 and out.left == [] and out.got == {}
    host = out.stat.tiers[0]
    assert host.blocks == 0 and host.bytes == 0 and host.reserved_bytes == 0


# (family, engine factory, beside a handoff): 5 full blocks in 3 forwards of 2 blocks (kimi_k3: a
# snapshot only at the prompt's last full block)
NO_SHARED = [
    pytest.param(LLAMA, LLAMA.make_engine, 3, False, id="llama-alone"),
    pytest.param(LLAMA, LLAMA.make_engine, 3, True, id="llama-beside-handoff"),
    pytest.param(K3, lambda **kw: K3.make_engine(every=0, **kw), 1, False, id="k3-alone"),
]


@pytest.mark.parametrize(("family", "make", "extra", "beside_handoff"), NO_SHARED)
def test_a_node_without_a_shared_pool_gets_each_block_whole_once_final_while_the_next_forward_computes(
        kvstore_node, family, make, extra, beside_handoff) -> None:  # noqa: ANN001
    node = kvstore_node(NO_SHARED_POOL)
    before = {m: mover_bytes(node.address, m) for m in ("shm-layers", "tcp")}
    engine = make(chunk=2 * family.page)
    out = export(engine, node.address, family.prompt(5 * family.page + extra, 6), beside_handoff=beside_handoff)
    layered, whole = out.layered, out.whole
    assert not out.client.takes_layers  # asked once: whole puts (the TCP side channel here) from then on
    assert out.left == [] and layered.stored == 5 and out.stat.tiers[0].reserved_bytes == 0
    assert {k: bytes(b.payload) for k, b in out.got.items()} == {b.key: bytes(b.payload) for b in whole}
    assert mover_bytes(node.address, "shm-layers") == before["shm-layers"]
    assert mover_bytes(node.address, "tcp") - before["tcp"] == layered.bytes_written == sum(b.nbytes for b in whole)
    # blocks 0-3 (kimi_k3: latents only) went while later forwards computed; block 4 (kimi_k3: with its snapshot) after
    assert layered.bytes_early == sum(b.nbytes for b in whole[:4])
    assert carries_state(engine, whole[4]) == family.stateful
    if beside_handoff:  # the blocks put were the handoff's buffers themselves
        copied_only_the_states(engine, family, out)


# ---- llama only: its layers' CRCs are taken as they land (layer-major, one range of a block each) ------

def test_a_damaged_llama_layer_is_refused_at_commit_and_never_served(kvstore_node) -> None:
    node = kvstore_node(POOL)
    engine = LLAMA.make_engine(chunk=8)
    tokens = [(7 * i + 2) % 97 for i in range(16)]

    def damage(block: int, layer: int, room: memoryview) -> None:  # after its CRC was taken, as a stray write
        if block == 1 and layer == 1:
            room[5] ^= 0xFF

    out = export(engine, node.address, tokens, paced=False, landed=damage)
    keys = out.seq.block_keys
    assert out.layered.stored == 3 and out.layered.rejected == 1 and out.left == []
    assert keys[1] not in out.got and all(keys[i] in out.got for i in (0, 2, 3))
    assert node.metric("crescent_kvstore_checksum_failures_total", tier="put") == 1  # refused on arrival
    assert out.stat.tiers[0].blocks == 3 and out.stat.tiers[0].reserved_bytes == 0


def test_llama_blocks_the_node_holds_are_not_sent_again(kvstore_node) -> None:
    node = kvstore_node(POOL)
    tokens = [(11 * i + 5) % 97 for i in range(16)]
    export(LLAMA.make_engine(), node.address, tokens, paced=False)
    out = export(LLAMA.make_engine(), node.address, tokens, paced=False)  # a fresh engine: a cold prompt again
    assert out.layered.bytes_written == 0 and out.left == [] and len(out.got) == 4 and out.stat.tiers[0].blocks == 4


def test_llama_room_held_too_long_is_given_back_and_its_blocks_left_to_the_whole_put(kvstore_node) -> None:
    node = kvstore_node({**POOL, "layer_reservation_ms": 200})

    def slow(block: int, layer: int, room: memoryview) -> None:  # a chunk's forward outlasting half the room's life
        if block == 0 and layer == 0:
            time.sleep(0.15)

    tokens = [(17 * i) % 97 for i in range(16)]
    out = export(LLAMA.make_engine(chunk=16), node.address, tokens, paced=False, landed=slow)
    assert out.left == [0, 1, 2, 3] and out.layered.stored == 0 and out.got == {}
    assert out.stat.tiers[0].reserved_bytes == 0 and out.stat.tiers[0].blocks == 0


# ---- kimi_k3 only: snapshots -------------------------------------------------------------------------

def test_a_cached_k3_prefix_is_not_exported_again(kvstore_node) -> None:
    node = kvstore_node(POOL)
    engine = K3.make_engine(chunk=2 * K3.page)
    first = K3.prompt(5 * K3.page + 3, 2)
    export(engine, node.address, first)
    out = export(engine, node.address, first[: 4 * K3.page] + K3.prompt(3 * K3.page + 1, 3))
    assert out.layered.first == 4 and out.layered.stored == 3 and out.left == []  # resumed from block 4's snapshot
    assert all(bytes(out.got[b.key].payload) == bytes(b.payload) for b in out.whole)


def test_a_block_whose_snapshot_is_gone_before_its_state_is_copied_goes_whole(kvstore_node) -> None:
    node = kvstore_node(POOL)
    engine = K3.make_engine(chunk=2 * K3.page)
    layout = engine.cache.layer_layout()
    tokens = K3.prompt(6 * K3.page + 4, 4)

    def lose_block_1s_snapshot(seq, layer: int, end: int) -> None:  # noqa: ANN001 - as an eviction would
        if end == len(tokens) and layer == layout.states_after:
            engine.cache.snapshots.drop(seq.pages[1])

    out = export(engine, node.address, tokens, before_layer=lose_block_1s_snapshot)
    assert out.left == [1] and out.layered.stored == 5 and out.whole[1].key not in out.got  # the whole put stores it
    assert not carries_state(engine, out.whole[1])  # ... without the state it lost
    assert all(bytes(out.got[b.key].payload) == bytes(b.payload) for b in out.whole if b.key in out.got)
