"""Same-GPU moves between an engine and the kvstore's GPU tier (``kvstore/cuda_ipc.py``).

What a user would notice: a block an engine exports from its device memory is stored by the
node's GPU tier and read back byte for byte, device to device, across two processes; and when
that cannot work (the engine on another GPU, IPC refused, a region that does not fit) the block
still arrives, through host bytes, and that peer is not asked to try IPC again.

On the CPU the device memory and its IPC are stood in by shared memory (``ipc_stand_in.py``): the
same node code opens, copies and falls back. The real CUDA IPC run (``cuda``) needs a GPU; it is
part of ``scripts/gpu_check.sh``'s test stage.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crescent.services.kvstore.config import GpuTierSettings
from crescent.services.kvstore.cuda_ipc import CUDA_IPC, DeviceRegion, IpcRefused, SameGpuPath
from crescent.services.kvstore.gpu_tier import GpuTier
from crescent.services.kvwire.kv_block import KvBlock

from .helpers import make_chain
from .ipc_stand_in import FAKE_GPU, ShmOpener

ROOT = Path(__file__).resolve().parents[2]
FLOATS = 256  # a block's payload: 1 KiB


def header_of(block: KvBlock) -> KvBlock:
    return KvBlock(block.key, block.parent_key, block.model_id, block.dtype, block.shape, block.token_ids, b"",
                   block.checksum, block.format_version)


def seeded_block(seed: int) -> KvBlock:
    """A block whose payload is the child's seeded bytes (the child computes the same ones)."""
    payload = torch.randint(0, 256, (4 * FLOATS,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    (template,) = make_chain(1, FLOATS)
    return KvBlock.build(template.key, None, template.model_id, "float32", (FLOATS,), template.token_ids,
                         payload.numpy().tobytes())


def tier(opener=None, device="cpu") -> GpuTier:  # noqa: ANN001
    return GpuTier(GpuTierSettings(enabled=True, capacity_bytes=1 << 20), device=device, opener=opener)


class Engine:
    """The engine process (``ipc_engine_child.py``): its block's region, then room for a read."""

    def __init__(self, kind: str, seed: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        args = [sys.executable, "-m", "tests.kvstore.ipc_engine_child", kind, str(4 * FLOATS), str(seed)]
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def line(self) -> str:
        assert self.proc.stdout is not None and self.proc.stdin is not None
        out = self.proc.stdout.readline().strip()
        assert out, f"the engine process exited ({self.proc.poll()})"
        return out

    def next(self) -> str:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self.line()

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0


async def round_trip(kind: str, node: GpuTier) -> None:
    block = seeded_block(seed=7)
    engine = Engine(kind, seed=7)
    try:
        path = SameGpuPath(node)
        region = DeviceRegion.from_bytes(bytes.fromhex(engine.line()))
        stored, how = await path.put("engine-a", header_of(block), region, lambda: pytest.fail("no host bytes needed"))
        assert stored and how == CUDA_IPC
        got = await node.read(block.key)  # the host path sees the very bytes
        assert got is not None and bytes(got.payload) == bytes(block.payload)
        got.verify(block.model_id)
        room = DeviceRegion.from_bytes(bytes.fromhex(engine.next()))
        header, how = await path.get("engine-a", block.key, room)
        assert how == CUDA_IPC and header.key == block.key and not header.payload
        assert bytes.fromhex(engine.next()) == bytes(block.payload)  # what the engine reads in its room
    finally:
        engine.close()


@pytest.mark.slow  # starts the engine's process
async def test_an_engine_process_puts_and_reads_a_block_device_to_device_stand_in() -> None:
    opener = ShmOpener()
    try:
        await round_trip("shm", tier(opener))
        assert opener.opened == 2
    finally:
        opener.close()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it)")
async def test_an_engine_process_puts_and_reads_a_block_device_to_device_cuda() -> None:
    await round_trip("cuda", GpuTier(GpuTierSettings(enabled=True, capacity_bytes=1 << 20)))


class Refusing:
    """An opener on a host without CUDA IPC (a container without --ipc=host, MIG)."""

    opened = 0

    def gpu_uuid(self, device):  # noqa: ANN001, ANN201
        return FAKE_GPU

    def open(self, region, device):  # noqa: ANN001, ANN201
        self.opened += 1
        raise IpcRefused("CUDA IPC refused: operation not supported")


def local_region(opener: ShmOpener, block: KvBlock, gpu: str = FAKE_GPU) -> DeviceRegion:
    src = opener.alloc(block.nbytes)
    src.copy_(torch.frombuffer(bytearray(block.payload), dtype=torch.uint8))
    region = opener.export(src)
    return DeviceRegion(gpu, region.handle, region.storage_bytes, 0, 0, region.nbytes)


@pytest.mark.parametrize("why", ["another gpu", "ipc refused", "wrong size"])
async def test_a_block_the_device_path_cannot_take_comes_through_host_bytes_and_the_peer_is_not_asked_again(why):
    opener = ShmOpener()
    try:
        node = tier(Refusing() if why == "ipc refused" else opener)
        path = SameGpuPath(node)
        a, b = make_chain(2, FLOATS)
        asked = []

        def host(block: KvBlock):  # noqa: ANN202
            return lambda: asked.append(block.key) or block.payload

        def region(block: KvBlock) -> DeviceRegion:
            r = local_region(opener, block, gpu="GPU-other" if why == "another gpu" else FAKE_GPU)
            return DeviceRegion(r.gpu_uuid, r.handle, r.storage_bytes, 0, 0, r.nbytes - 4) if why == "wrong size" else r

        stored, how = await path.put("engine-a", header_of(a), region(a), host(a))
        assert stored and how == "host" and asked == [a.key]
        got = await node.read(a.key)
        assert got is not None and bytes(got.payload) == bytes(a.payload)
        opened = node.opener.opened
        stored, how = await path.put("engine-a", header_of(b), region(b), host(b))  # not tried again
        assert stored and how == "host" and node.opener.opened == opened
        assert not path.device_ok("engine-a") and path.device_ok("engine-b")  # refused per peer
        block, how = await path.get("engine-a", a.key, None)
        assert how == "host" and bytes(block.payload) == bytes(a.payload)
    finally:
        opener.close(unlink=True)


async def test_a_peer_on_this_gpu_keeps_the_device_path_and_misses_are_misses() -> None:
    opener = ShmOpener()
    try:
        node = tier(opener)
        path = SameGpuPath(node)
        a, b = make_chain(2, FLOATS)
        for block in (a, b):
            stored, how = await path.put("engine-a", header_of(block), local_region(opener, block), lambda: b"")
            assert stored and how == CUDA_IPC
        room = opener.alloc(b.nbytes)
        header, how = await path.get("engine-a", b.key, opener.export(room))
        assert how == CUDA_IPC and bytes(room.numpy()) == bytes(b.payload)
        assert await path.get("engine-a", make_chain(1, FLOATS)[0].key, opener.export(room)) == (None, "")
        assert node.used_bytes == 2 * a.nbytes  # the tier counts device-moved blocks as any others
    finally:
        opener.close(unlink=True)


def test_a_region_travels_as_json_bytes_and_garbage_is_refused() -> None:
    region = DeviceRegion("GPU-1234", bytes(range(64)), 4096, 512, 128, 1024, b"\x01" * 8, 16, None, True)
    assert DeviceRegion.from_bytes(region.to_bytes()) == region
    for junk in (b"\x80\x04pickle", b"{}", b'{"gpu_uuid": 1}'):
        with pytest.raises(IpcRefused):
            DeviceRegion.from_bytes(junk)


async def test_the_store_places_a_device_moved_block_like_any_put() -> None:
    """Room by eviction (the oldest block demoted to the host tier), events for the index, the
    node's CRC on its copy, and a block whose bytes are not its header's refused."""
    from crescent.protos import common_pb2
    from crescent.services.common.metrics import kvstore_metrics
    from crescent.services.kvstore.config import HostTierSettings
    from crescent.services.kvstore.store import TieredStore
    from crescent.services.kvstore.tier import HostTier

    opener = ShmOpener()
    try:
        gpu = GpuTier(GpuTierSettings(enabled=True, capacity_bytes=3 * 4 * FLOATS, high_watermark=1.0, low_watermark=1.0),
                      device="cpu", opener=opener)
        host = HostTier(HostTierSettings(capacity_bytes=8 * 4 * FLOATS, page_bytes=4 * FLOATS))
        store = TieredStore([gpu, host], kvstore_metrics())
        events = []
        store.subscribe(events.append)
        chain = make_chain(5, FLOATS)
        *fits, bad = chain
        for i, block in enumerate(fits):  # the engine sent no checksum for the odd ones
            assert await store.put_from_region(header_of(block) if i % 2 == 0 else
                                               dataclasses.replace(header_of(block), checksum=0),
                                               local_region(opener, block))
        assert not await store.put_from_region(dataclasses.replace(header_of(bad), checksum=bad.checksum ^ 1),
                                               local_region(opener, bad))
        assert store.location(fits[0].key) == 1 and all(store.location(b.key) == 0 for b in fits[1:])
        assert store.location(bad.key) is None
        stored = [(e.key, e.tier) for e in events if e.kind == common_pb2.BLOCK_EVENT_STORED]
        assert stored == [(b.key, common_pb2.KV_TIER_GPU) for b in fits]
        assert [(e.key, e.tier) for e in events if e.kind == common_pb2.BLOCK_EVENT_TIER_CHANGED] == \
            [(fits[0].key, common_pb2.KV_TIER_HOST)]
        for block in fits:  # verified host reads: the node's CRC is the bytes'
            got = await store.get(block.key, block.model_id, verify=True)
            assert got is not None and bytes(got.payload) == bytes(block.payload)
    finally:
        opener.close(unlink=True)
