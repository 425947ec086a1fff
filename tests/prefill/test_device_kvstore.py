"""Prefill's kvstore export and prefix load through the node's GPU tier, device to device
(``services/prefill/device_store.py``, ``services/engine/device_blocks.py``).

What a user would notice: a prompt's new blocks land in the node's GPU tier without the engine
making host bytes of them, and are the very bytes the host export stores (any host reader gets
them, checksummed); the next request with that prompt, on another prefill engine, loads them back
from the GPU tier and decodes exactly the tokens single-process generation gives. A node that
cannot take device blocks (no GPU tier here) still gets the same bytes, through host bytes, and
later requests use the host path as before. A pool on the CPU builds nothing of this.

On this CPU the node is a real kvstore process whose GPU tier is the shared-memory stand-in
(``tests/kvstore/ipc_node.py``), and the engine's "device rooms" are shared memory from the same
stand-in (``ShmOpener``): the CPU pool plays the device pool, the same code gathers, exports,
gets and attaches. The real-CUDA variant (``…_cuda``) needs a GPU (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import pytest
import torch

from crescent.protos import common_pb2, prefill_pb2
from crescent.services.common.metrics import engine_metrics
from crescent.services.engine.device_blocks import DeviceBlocks
from crescent.services.engine.engine import Engine
from crescent.services.engine.kv_cache import PagedKvCache
from crescent.services.engine.llama import LlamaModel
from crescent.services.engine.sampler import SamplingConfig, sample_batch
from crescent.services.instance.runtime import EngineWorker
from crescent.services.instance.wire import kv_dtype
from crescent.services.kvstore.client import KvStoreClient, wait_ready
from crescent.services.kvstore.cuda_ipc import CUDA_IPC, CudaIpc
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.prefill.batcher import PrefillBatcher
from crescent.services.prefill.config import PrefillBaseSettings
from crescent.services.prefill.device_store import DeviceStore
from crescent.services.prefill.load import PrefillLoad
from crescent.services.prefill.pipeline import FirstToken, HandedOff, PrefillPipeline
from crescent.services.prefill.prompt_export import owned_bytes
from crescent.services.prefill.server import kvstore_client
from crescent.services.prefill.servicer import PrefillServicer
from tests.engine.tiny_model import TINY, tiny_weights
from tests.kvstore.ipc_stand_in import ShmOpener
from tests.prefill.test_pipeline import DECODE, LandingSink

PAGE = 16  # a key tile of the Triton kernels on CUDA has at least 16 tokens (the ``…_cuda`` variant)
GPU_NODE = {"tiers": {"gpu": {"enabled": True, "capacity_bytes": 64 << 10}}}
STAND_IN = "tests.kvstore.ipc_node"
PROMPT = [(7 * i + 3) % 97 for i in range(4 * PAGE + 3)]  # 4 full blocks, and 3 tokens
CACHED = 4 * PAGE  # a prefix hit leaves the last token to compute: the 4 full blocks
MAX_TOKENS = 6


def make_engine(device: str = "cpu") -> Engine:
    torch.set_num_threads(1)
    return Engine(LlamaModel(TINY, tiny_weights(TINY), device=device), model_id="tiny",
                  kv_capacity_tokens=64 * PAGE, block_size=PAGE, prefill_chunk_tokens=2 * PAGE)


class StandInRooms:
    """``DeviceRooms`` of the stand-in: shared memory its ``ShmOpener`` exports."""

    def __init__(self, opener: ShmOpener) -> None:
        self.opener = opener
        self.made = self.freed = 0

    def alloc(self, nbytes: int) -> torch.Tensor:
        self.made += 1
        return self.opener.alloc(nbytes)

    def free(self, rooms) -> None:  # noqa: ANN001
        for room in rooms:
            self.opener.free(room)
            self.freed += 1


class Counted:
    """Calls of one of the client's methods (``put``: host-bytes puts; ``get_prefix``: host gets)."""

    def __init__(self, client: KvStoreClient, name: str) -> None:
        self.calls = 0
        inner = getattr(client, name)

        async def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.calls += 1
            return await inner(*args, **kwargs)
        setattr(client, name, counted)


def request(rid: str, prompt: list[int] = PROMPT) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(request_id=rid, token_ids=prompt, decode_address=DECODE,
                                      sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


async def prefill(engine: Engine, client: KvStoreClient, rid: str, device_blocks: DeviceBlocks | None,
                  prompt: list[int] = PROMPT):
    """One request of ``prompt`` through a ``PrefillPipeline`` with an engine thread, as a prefill
    process runs it, its kvstore export awaited; (its events, what decode's intake landed)."""
    worker = EngineWorker("prefill")
    thread = threading.Thread(target=worker.serve_forever)
    thread.start()
    metrics = engine_metrics("prefill")
    batcher = PrefillBatcher(engine, worker, 0, metrics)
    tasks: list[asyncio.Task] = []
    sink = LandingSink(engine)
    pipeline = PrefillPipeline(engine=engine, worker=worker, batcher=batcher, metrics=metrics, load=PrefillLoad(),
                               sink=sink, spawn=lambda c: tasks.append(asyncio.create_task(c)), kvstore=client,
                               device_blocks=device_blocks)
    run = pipeline.start(request(rid, prompt))
    try:
        events = [event async for event in run.events()]
    finally:
        await run.close()
        await asyncio.gather(*tasks)
        await batcher.close()
        worker.shutdown()
        await asyncio.to_thread(thread.join)
    return events, sink.landed[0]


def host_export(engine: Engine) -> list[KvBlock]:
    """The prompt's full blocks as the host export (``_export_new_blocks``) stores them, from the
    very pages the engine's prefix cache keeps of the prompt."""
    seq = engine.add_sequence("again", PROMPT)
    assert seq.num_cached == CACHED, "the prompt's full blocks are in the engine's prefix cache"
    keys = seq.block_keys
    blocks = [KvBlock.build(keys[i], keys[i - 1] if i else None, engine.model_id, kv_dtype(engine.cache),
                            engine.cache.block_shape, PROMPT[i * PAGE : (i + 1) * PAGE],
                            owned_bytes(engine.block_payload(seq, i, PAGE)))
              for i in range(len(keys))]
    engine.release(seq)
    return blocks


def decode_rest(engine: Engine, landed) -> list[int]:  # noqa: ANN001 - a landed handoff
    """Decode a landed handoff greedily to ``MAX_TOKENS`` (as a decode instance would; a kimi_k3
    handoff's last block carries the live state)."""
    prompt, out = list(landed.header.prompt_token_ids), [landed.header.first_token_id]
    seq = engine.adopt_sequence("d", [*prompt, out[0]], len(prompt), landed.payloads)
    while len(out) < MAX_TOKENS:
        token = sample_batch(engine.decode_step([seq]), [SamplingConfig()], [len(out)], [[*prompt, *out]], None)[0]
        out.append(token)
        seq.token_ids.append(token)
    engine.release(seq)
    return out


async def stored_blocks(address: str, keys, model_id: str = "tiny") -> dict:  # noqa: ANN001
    reader = KvStoreClient(address)  # any reader: host bytes, verified against the stored checksum
    try:
        return await reader.get(keys, model_id)
    finally:
        await reader.close()


async def gpu_blocks(client: KvStoreClient) -> int:
    stat = await client.stat()
    assert stat is not None
    return sum(t.blocks for t in stat.tiers if t.tier == common_pb2.KV_TIER_GPU)


async def device_round_trip(node, client: KvStoreClient, make_blocks, device: str) -> None:  # noqa: ANN001
    """The prompt's blocks go device to device into the node and back into another engine."""
    first = make_engine(device)
    events, _ = await prefill(first, client, "r1", make_blocks(first))
    assert isinstance(events[0], FirstToken) and events[0].cached_tokens == 0
    assert client.mover == CUDA_IPC and client.device_path_open
    expected = host_export(first)
    assert await gpu_blocks(client) == len(expected)
    read = await stored_blocks(node.address, [b.key for b in expected])
    assert [(bytes(read[b.key].payload), read[b.key].checksum) for b in expected] == \
           [(bytes(b.payload), b.checksum) for b in expected], "the host export's bytes and checksums"

    second = make_engine(device)  # nothing cached here: the prefix comes from the node
    hits = node.metric("crescent_kvstore_hits_total", tier="gpu")
    gets = Counted(client, "get_prefix")
    events, landed = await prefill(second, client, "r2", make_blocks(second))
    assert isinstance(events[0], FirstToken) and events[0].cached_tokens == CACHED and events[1] == HandedOff(DECODE)
    assert gets.calls == 0 and client.mover == CUDA_IPC, "loaded device to device, no host get"
    assert node.metric("crescent_kvstore_hits_total", tier="gpu") == hits + CACHED // PAGE
    assert decode_rest(make_engine(device), landed) == make_engine(device).generate(PROMPT, MAX_TOKENS,
                                                                                    stop_token_ids=[])


@asynccontextmanager
async def stand_in_client(address: str) -> AsyncIterator[tuple[KvStoreClient, ShmOpener]]:
    """A ready kvstore client whose device memory is the shared-memory stand-in; closed after."""
    opener = ShmOpener()
    client = KvStoreClient(address, device_opener=opener)
    try:
        assert await wait_ready(client)
        yield client, opener
    finally:
        await client.close()
        opener.close(unlink=True)


@pytest.mark.slow  # a node process
async def test_a_prompts_blocks_go_device_to_device_into_the_gpu_tier_and_back(kvstore_node) -> None:
    node = kvstore_node(GPU_NODE, module=STAND_IN)
    async with stand_in_client(node.address) as (client, opener):
        rooms = StandInRooms(opener)
        puts = Counted(client, "put")
        await device_round_trip(node, client, lambda engine: DeviceBlocks(engine.cache, rooms), "cpu")
        assert puts.calls == 0, "no host-bytes put"
        # r1: its load that missed, then its export; r2: its load. Every room went back.
        assert rooms.made == rooms.freed == 3 * (CACHED // PAGE)


@pytest.mark.slow  # a node process
async def test_a_node_without_a_gpu_tier_gets_the_same_bytes_through_the_host_path(kvstore_node) -> None:
    node = kvstore_node({}, module=STAND_IN)
    async with stand_in_client(node.address) as (client, opener):
        puts = Counted(client, "put")
        first = make_engine()
        await prefill(first, client, "r1", DeviceBlocks(first.cache, StandInRooms(opener)))
        assert puts.calls == 1 and client.mover != CUDA_IPC, "put_device moved host bytes itself"
        assert not client.device_path_open, "cuda_ipc refused for this node, for good"
        expected = host_export(first)
        read = await stored_blocks(node.address, [b.key for b in expected])
        assert [bytes(read[b.key].payload) for b in expected] == [bytes(b.payload) for b in expected]

        second = make_engine()
        rooms, gets = StandInRooms(opener), Counted(client, "get_prefix")
        events, landed = await prefill(second, client, "r2", DeviceBlocks(second.cache, rooms))
        assert events[0].cached_tokens == CACHED and gets.calls == 1 and rooms.made == 0, "the host path, as before"
        assert decode_rest(make_engine(), landed) == make_engine().generate(PROMPT, MAX_TOKENS, stop_token_ids=[])


async def test_a_pool_on_the_cpu_takes_no_device_path() -> None:
    """A prefill process on the CPU builds what it built before: no device opener, no device rooms."""
    engine = make_engine()
    assert DeviceBlocks.for_cache(engine.cache) is None
    meta = PagedKvCache(4, 2, PAGE, 2, 8, device="meta")
    assert DeviceBlocks.for_cache(meta) is None  # only CUDA: the meta device stands in for "not a GPU"
    settings = PrefillBaseSettings(scheduler_address="127.0.0.1:1", kvstore_address="127.0.0.1:2")
    client = kvstore_client(settings, SimpleNamespace(engine=engine, tls=None))  # the process's own wiring
    assert client is not None
    servicer = PrefillServicer(engine, EngineWorker("prefill"), client, 0, lambda: None)
    try:
        assert CUDA_IPC not in [m.name for m in client.movers] and not client.device_path_open
        assert servicer.pipeline.device is None and not servicer.pipeline.on_device
    finally:
        await servicer.close()
        await client.close()


def test_gathered_rooms_hold_a_blocks_bytes_and_attach_as_its_pages() -> None:
    """The gather is the block's bytes; a room attached to another engine is that block there."""
    engine, other = make_engine(), make_engine()

    class PlainRooms:
        def alloc(self, nbytes: int) -> torch.Tensor:
            return torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # filled: a read of unwritten room shows

        def free(self, rooms) -> None:  # noqa: ANN001
            pass

    blocks = DeviceBlocks(engine.cache, PlainRooms())
    seq = engine.add_sequence("s", PROMPT)
    engine.prefill(seq)
    gathered = blocks.gather(engine, seq, range(4))  # each its room, seen as the block's payload
    assert all(tuple(p.shape) == tuple(engine.cache.block_shape) for p in gathered)
    assert [bytes(p.view(torch.uint8).reshape(-1).numpy()) for p in gathered] == \
           [bytes(b.payload) for b in host_export(engine)]
    into = other.add_sequence("t", PROMPT)
    assert other.attach_blocks(into, gathered) == CACHED
    assert all(torch.equal(other.block_payload(into, i), engine.block_payload(seq, i)) for i in range(4))


class OutOfRooms:
    def alloc(self, nbytes: int) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (a test's)")

    def free(self, rooms) -> None:  # noqa: ANN001
        pass


class InlineWorker:
    async def run(self, fn, *args):  # noqa: ANN001, ANN002, ANN201
        return fn(*args)


async def test_no_device_memory_for_rooms_costs_the_cache_not_the_request() -> None:
    """Rooms that cannot be had: the load is left to the host path, the export stores nothing,
    the prompt's pages go back, and nothing raises into the request (no kvstore call is made)."""
    engine = make_engine()
    store = DeviceStore(engine, InlineWorker(), None, DeviceBlocks(engine.cache, OutOfRooms()), engine_metrics("prefill"))
    seq = engine.add_sequence("s", PROMPT)
    assert await store.attach(seq, engine.missing_prefix_keys(seq), 0) == (0, True)  # (nothing, ask the host way)
    engine.prefill(seq)
    released = []
    await store.store(seq, 0, lambda: released.append(True), 0.0)
    assert released == [True]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it)")
async def test_a_prompts_blocks_go_device_to_device_into_the_gpu_tier_and_back_cuda(kvstore_node) -> None:
    node = kvstore_node(GPU_NODE)  # the node's own GPU tier on this GPU, real CUDA IPC
    client = KvStoreClient(node.address, device_opener=CudaIpc())
    puts = Counted(client, "put")
    try:
        assert await wait_ready(client)

        def on_gpu(engine: Engine) -> DeviceBlocks:
            blocks = DeviceBlocks.for_cache(engine.cache)
            assert blocks is not None, "a pool on CUDA takes the device path"
            return blocks

        await device_round_trip(node, client, on_gpu, "cuda")
        assert puts.calls == 0, "no host-bytes put"
    finally:
        await client.close()
