"""Kimi K3's kvstore export and prefix load through the node's GPU tier, device to device
(``services/prefill/device_store.py``, ``services/engine/device_blocks.py``).

What a user would notice: a K3 prompt's new blocks land in the node's GPU tier without the engine
making host bytes of them, each the very bytes and shape the host export stores (latents, and the
KDA state in front where the host export puts one: here blocks 2 and 4 carry one, 0, 1 and 3 do
not), so any host reader gets them; the next request with that prompt, on another engine, loads
them back from the GPU tier (a block with a state does not fit its first room, so it is got again
into a room of its size) and decodes exactly the tokens single-process generation gives. A node
without a GPU tier gets the same bytes through host bytes.

On this CPU the node is a real kvstore process whose GPU tier is the shared-memory stand-in and
the engine's "device rooms" are shared memory (as ``test_device_kvstore.py`` does for Llama). The
real-CUDA variant (``…_cuda``) needs a GPU (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import pytest
import torch

from crescent.services.common.metrics import engine_metrics
from crescent.services.engine.device_blocks import DeviceBlocks
from crescent.services.engine.engine import Engine
from crescent.services.engine.kimi_k3.model import K3Model
from crescent.services.engine.kimi_k3.snapshots import SnapshotPolicy
from crescent.services.instance.wire import kv_dtype
from crescent.services.kvstore.client import KvStoreClient, wait_ready
from crescent.services.kvstore.cuda_ipc import CUDA_IPC, CudaIpc
from crescent.services.kvwire.kv_block import KvBlock, expected_nbytes
from crescent.services.prefill import device_store
from crescent.services.prefill.device_store import DeviceStore
from crescent.services.prefill.pipeline import FirstToken, HandedOff
from crescent.services.prefill.prompt_export import owned_bytes
from tests.engine import test_kimi_k3_snapshots as k3
from tests.kvstore.ipc_stand_in import ShmOpener
from tests.prefill.test_device_kvstore import (STAND_IN, Counted, InlineWorker, MAX_TOKENS, StandInRooms,
                                               decode_rest, gpu_blocks, prefill, stand_in_client, stored_blocks)
from tests.prefill.test_pipeline import DECODE

PAGE = k3.PAGE  # 16
PROMPT = k3.prompt(5 * PAGE + 3, seed=3)  # 5 full blocks, and 3 tokens
EVERY = 3  # snapshots at the end of block 2 (every 3rd) and block 4 (the prompt's last full block)
WITH_STATE = [False, False, True, False, True]
CACHED = 5 * PAGE  # a prefix hit resumes after block 4, the last one with a state
GPU_NODE = {"tiers": {"gpu": {"enabled": True, "capacity_bytes": 256 << 10}}}


def make_engine(device: str = "cpu") -> Engine:
    torch.set_num_threads(1)
    model = K3Model(k3.TEST_CFG, k3._weights(), device=device, snapshots=SnapshotPolicy(every_blocks=EVERY, slots=32))
    return Engine(model, model_id="k3-test", kv_capacity_tokens=64 * PAGE, block_size=PAGE)


def host_export(device: str = "cpu", prompt: list[int] = PROMPT) -> list[KvBlock]:
    """The prompt's full blocks as the host export stores them (``PromptExport``: each block's
    ``block_payload`` right after the prompt is computed), from an engine of their own."""
    engine = make_engine(device)
    seq = engine.add_sequence("host", prompt)
    engine.prefill(seq)
    keys = seq.block_keys
    blocks = []
    for i in range(len(keys)):
        payload = engine.block_payload(seq, i, PAGE).cpu()
        blocks.append(KvBlock.build(keys[i], keys[i - 1] if i else None, engine.model_id, kv_dtype(engine.cache),
                                    tuple(payload.shape), prompt[i * PAGE : (i + 1) * PAGE], owned_bytes(payload)))
    engine.release(seq)
    if prompt is PROMPT:
        assert [engine.cache.payload_has_state(b.shape) for b in blocks] == WITH_STATE
    return blocks


def single_process() -> list[int]:
    return make_engine().generate(PROMPT, MAX_TOKENS, stop_token_ids=[])


async def k3_round_trip(node, client: KvStoreClient, make_blocks, device: str) -> None:  # noqa: ANN001
    """The K3 prompt's blocks go device to device into the node and back into another engine."""
    first = make_engine(device)
    events, _ = await prefill(first, client, "r1", make_blocks(first), PROMPT)
    assert isinstance(events[0], FirstToken) and events[0].cached_tokens == 0
    assert client.mover == CUDA_IPC and client.device_path_open
    expected = host_export(device)
    assert await gpu_blocks(client) == len(expected)
    read = await stored_blocks(node.address, [b.key for b in expected], "k3-test")
    assert [(tuple(read[b.key].shape), bytes(read[b.key].payload), read[b.key].checksum) for b in expected] == \
           [(tuple(b.shape), bytes(b.payload), b.checksum) for b in expected], "the host export's blocks, states and all"

    second = make_engine(device)  # nothing cached here: the prefix comes from the node
    hits = node.metric("crescent_kvstore_hits_total", tier="gpu")
    gets, device_gets = Counted(client, "get_prefix"), Counted(client, "get_device")
    events, landed = await prefill(second, client, "r2", make_blocks(second), PROMPT)
    assert isinstance(events[0], FirstToken) and events[0].cached_tokens == CACHED and events[1] == HandedOff(DECODE)
    assert gets.calls == 0 and client.mover == CUDA_IPC, "loaded device to device, no host get"
    # batches of 2 blocks: [0, 1], [2, 3] and [4]; the last two asked again for the block with a state
    assert device_gets.calls == 5
    assert node.metric("crescent_kvstore_hits_total", tier="gpu") == hits + len(expected)  # one hit a block
    assert decode_rest(make_engine(device), landed) == make_engine(device).generate(PROMPT, MAX_TOKENS,
                                                                                    stop_token_ids=[])


@pytest.mark.slow  # a node process
async def test_a_k3_prompts_blocks_and_states_go_device_to_device_into_the_gpu_tier_and_back(
        kvstore_node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_store, "DEVICE_BATCH_BLOCKS", 2)  # blocks without a state held across batches
    node = kvstore_node(GPU_NODE, module=STAND_IN)
    async with stand_in_client(node.address) as (client, opener):
        rooms = StandInRooms(opener)
        puts = Counted(client, "put")
        await k3_round_trip(node, client, lambda engine: DeviceBlocks(engine.cache, rooms), "cpu")
        assert puts.calls == 0, "no host-bytes put"
        assert rooms.made == rooms.freed


@pytest.mark.slow  # a node process
async def test_a_node_without_a_gpu_tier_gets_a_k3_prompts_same_blocks_through_the_host_path(kvstore_node) -> None:
    node = kvstore_node({}, module=STAND_IN)
    async with stand_in_client(node.address) as (client, opener):
        puts = Counted(client, "put")
        first = make_engine()
        await prefill(first, client, "r1", DeviceBlocks(first.cache, StandInRooms(opener)), PROMPT)
        assert puts.calls == 1 and client.mover != CUDA_IPC, "put_device moved host bytes itself"
        assert not client.device_path_open, "cuda_ipc refused for this node, for good"
        expected = host_export()
        read = await stored_blocks(node.address, [b.key for b in expected], "k3-test")
        assert [(tuple(read[b.key].shape), bytes(read[b.key].payload)) for b in expected] == \
               [(tuple(b.shape), bytes(b.payload)) for b in expected]

        second = make_engine()
        rooms, gets = StandInRooms(opener), Counted(client, "get_prefix")
        events, landed = await prefill(second, client, "r2", DeviceBlocks(second.cache, rooms), PROMPT)
        assert events[0].cached_tokens == CACHED and gets.calls == 1 and rooms.made == 0, "the host path, as before"
        assert decode_rest(make_engine(), landed) == single_process()


# ---- no process: the gather, and the load's two sizes against a node's rule --------------------


class PlainRooms:
    def __init__(self) -> None:
        self.live: dict[int, int] = {}  # data_ptr -> bytes, rooms not freed yet

    def alloc(self, nbytes: int) -> torch.Tensor:
        room = torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # filled: a read of unwritten room shows
        self.live[room.data_ptr()] = nbytes
        return room

    def free(self, rooms) -> None:  # noqa: ANN001
        for room in rooms:
            del self.live[room.data_ptr()]  # raises on a room freed twice


def test_a_k3_gather_is_the_host_exports_blocks_and_attaches_with_its_states() -> None:
    engine, other = make_engine(), make_engine()
    rooms = PlainRooms()
    blocks = DeviceBlocks(engine.cache, rooms)
    seq = engine.add_sequence("s", PROMPT)
    engine.prefill(seq)
    gathered = blocks.gather(engine, seq, range(5))
    expected = host_export()
    assert [tuple(p.shape) for p in gathered] == [tuple(b.shape) for b in expected]
    assert [bytes(p.reshape(-1).view(torch.uint8).numpy()) for p in gathered] == [bytes(b.payload) for b in expected]
    assert sorted(rooms.live.values()) == sorted(expected_nbytes(b.dtype, b.shape) for b in expected)  # each its size
    assert blocks.attachable(gathered[:2]) == 0 and blocks.attachable(gathered[:4]) == 3
    into = other.add_sequence("t", PROMPT)
    assert other.attach_blocks(into, gathered) == CACHED  # resumes from block 4's state
    blocks.free(gathered)
    assert not rooms.live
    out = [int(torch.argmax(other.prefill(into)))]
    while len(out) < MAX_TOKENS:
        into.token_ids.append(out[-1])
        out.append(int(torch.argmax(other.decode_step([into])[0])))
    assert out == single_process()


def test_a_prompt_that_fills_its_last_block_gathers_its_live_state_as_the_host_export_does() -> None:
    """Exactly 5 blocks: the last one is the last computed, its payload carries the live state."""
    prompt = PROMPT[: 5 * PAGE]
    engine = make_engine()
    blocks = DeviceBlocks(engine.cache, PlainRooms())
    seq = engine.add_sequence("s", prompt)
    engine.prefill(seq)
    gathered = blocks.gather(engine, seq, range(5))
    expected = host_export(prompt=prompt)
    assert [engine.cache.payload_has_state(b.shape) for b in expected] == [False, False, True, True, True]
    assert [(tuple(p.shape), bytes(p.reshape(-1).view(torch.uint8).numpy())) for p in gathered] == \
           [(tuple(b.shape), bytes(b.payload)) for b in expected]


class RoomRuleNode:
    """``get_device`` as a node with a GPU tier answers it (``TieredStore.get_into``): a block is
    copied into a room of its size; a room too small is left alone, the header returned."""

    device_path_open = True

    def __init__(self, blocks: list[KvBlock]) -> None:
        self.blocks = {b.key: b for b in blocks}
        self.calls: list[int] = []  # keys asked per call

    async def get_device(self, keys, rooms, model_id=None, lease_ms=0, *, stop_at_first_miss=False):  # noqa: ANN001, ANN201
        self.calls.append(len(keys))
        found = {}
        for key, room in zip(keys, rooms):
            block = self.blocks.get(key)
            if block is None:
                if stop_at_first_miss:
                    break
                continue
            if room.numel() == block.nbytes:
                room.copy_(torch.frombuffer(bytearray(block.payload), dtype=torch.uint8))
            found[key] = KvBlock(block.key, block.parent_key, block.model_id, block.dtype, block.shape,
                                 block.token_ids, b"", block.checksum)
        return found


@pytest.mark.parametrize(("held", "cached", "calls"), [
    (5, CACHED, [2, 2, 1, 1, 1]),  # all: [0, 1] held, [2] attaches them, [3] held, [4] attaches it
    (4, 3 * PAGE, [2, 2, 1, 1]),    # block 4 missing: block 3 (no state after it) is given up
    (2, 0, [2, 2]),                 # no state at all: nothing attached, every room back
])
async def test_a_k3_load_sizes_rooms_per_block_and_attaches_up_to_the_last_state(held: int, cached: int,
                                                                                  calls: list[int],
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_store, "DEVICE_BATCH_BLOCKS", 2)
    node = RoomRuleNode(host_export()[:held])
    engine, rooms = make_engine(), PlainRooms()
    store = DeviceStore(engine, InlineWorker(), node, DeviceBlocks(engine.cache, rooms), engine_metrics("prefill"))
    seq = engine.add_sequence("s", PROMPT)
    added, missed = await store.attach(seq, engine.missing_prefix_keys(seq), 0)
    assert (added, missed) == (cached, held < 5) and node.calls == calls
    assert not rooms.live, "every room went back"
    if cached:
        expected = host_export()
        assert all(bytes(engine.block_payload(seq, i, PAGE).reshape(-1).view(torch.uint8).numpy()) ==
                   bytes(expected[i].payload) for i in range(cached // PAGE))


async def test_the_node_leaves_a_room_too_small_for_a_block_alone_and_says_its_shape() -> None:
    """``TieredStore.get_into``, the node's side of the two sizes: a K3 block with a state asked
    into a room of a block without one comes back as its header only (the room untouched, no hit
    counted), from the GPU tier or from a slower one; into a room of its size, its bytes."""
    from crescent.services.common.metrics import kvstore_metrics
    from crescent.services.kvstore.config import GpuTierSettings, HostTierSettings
    from crescent.services.kvstore.gpu_tier import GpuTier
    from crescent.services.kvstore.store import TieredStore
    from crescent.services.kvstore.tier import HostTier

    blocks = host_export()
    without = blocks[0].nbytes  # a room for a block without a state
    on_gpu, on_host = blocks[2], blocks[4]  # blocks with a state
    opener = ShmOpener()
    try:
        gpu = GpuTier(GpuTierSettings(enabled=True, capacity_bytes=1 << 20), device="cpu", opener=opener)
        host = HostTier(HostTierSettings(capacity_bytes=1 << 20, page_bytes=without))
        store = TieredStore([gpu, host], kvstore_metrics())
        assert await store.put(on_gpu) and store.location(on_gpu.key) == 0
        assert await host.write(on_host) and store.location(on_host.key) == 1
        for block in (on_gpu, on_host):
            room = opener.alloc(without)
            room.fill_(0xAB)
            hits = [h._value.get() for h in store._hits]
            header = await store.get_into(block.key, block.model_id, opener.export(room))
            assert header is not None and tuple(header.shape) == tuple(block.shape)
            assert bytes(room.numpy()) == b"\xab" * without, "a room too small is left alone"
            if block is on_gpu:
                assert [h._value.get() for h in store._hits] == hits, "no hit until its bytes are read"
            room = opener.alloc(block.nbytes)
            header = await store.get_into(block.key, block.model_id, opener.export(room))
            assert header is not None and bytes(room.numpy()) == bytes(block.payload)
    finally:
        opener.close(unlink=True)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it)")
async def test_a_k3_prompts_blocks_and_states_go_device_to_device_into_the_gpu_tier_and_back_cuda(
        kvstore_node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_store, "DEVICE_BATCH_BLOCKS", 2)
    node = kvstore_node(GPU_NODE)  # the node's own GPU tier on this GPU, real CUDA IPC
    client = KvStoreClient(node.address, device_opener=CudaIpc())
    puts = Counted(client, "put")
    try:
        assert await wait_ready(client)

        def on_gpu(engine: Engine) -> DeviceBlocks:
            blocks = DeviceBlocks.for_cache(engine.cache)
            assert blocks is not None and blocks.stateful, "a kimi_k3 cache on CUDA takes the device path"
            return blocks

        await k3_round_trip(node, client, on_gpu, "cuda")
        assert puts.calls == 0, "no host-bytes put"
    finally:
        await client.close()
