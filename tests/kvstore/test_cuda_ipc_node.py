"""Device blocks through a real kvstore node: the client's ``cuda_ipc`` mover, the node's
``PutRegion``/``GetRegion`` and ``TieredStore`` placing them (``kvstore/cuda_ipc.py``).

What a user would notice: an engine's blocks on the node's GPU go into the node's GPU tier and come
back into the engine's memory byte for byte without host bytes, and count as the node's blocks
(listed in its GPU tier, hits counted, readable by any host client, checksummed); when the node is
on another GPU, has no GPU tier, or cannot open the engine's memory, the same calls still store and
read the blocks, through host bytes, and that node is not asked to use IPC again.

On this CPU the node process is ``ipc_node.py`` (the node's own code, its GPU tier the
shared-memory stand-in of ``ipc_stand_in.py``) and the client's "device memory" is shared memory.
The real-CUDA variant needs a GPU (``scripts/gpu_check.sh``'s kernel_tests stage).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from crescent.protos import common_pb2
from crescent.services.kvstore.client import KvStoreClient, wait_ready
from crescent.services.kvstore.cuda_ipc import CUDA_IPC, CudaIpc, DeviceRegion
from crescent.services.kvwire.kv_block import KvBlock

from .helpers import make_chain
from .ipc_stand_in import ShmOpener

FLOATS = 256  # 1 KiB blocks
GPU_NODE = {"tiers": {"gpu": {"enabled": True, "capacity_bytes": 64 << 10}}}
STAND_IN = "tests.kvstore.ipc_node"

pytestmark = pytest.mark.slow  # node processes


def on_device(opener: ShmOpener, block: KvBlock) -> torch.Tensor:
    tensor = opener.alloc(block.nbytes)
    tensor.copy_(torch.frombuffer(bytearray(block.payload), dtype=torch.uint8))
    return tensor


def header(block: KvBlock, checksum: int | None = None) -> KvBlock:
    """What an engine knows of a device block: no host bytes, a checksum only if it has one."""
    return dataclasses.replace(block, payload=b"", checksum=block.checksum if checksum is None else checksum)


async def gpu_blocks(client: KvStoreClient) -> int:
    stat = await client.stat()
    assert stat is not None
    return sum(t.blocks for t in stat.tiers if t.tier == common_pb2.KV_TIER_GPU)


async def test_device_blocks_go_device_to_device_into_the_nodes_gpu_tier_and_back(kvstore_node) -> None:
    node = kvstore_node(GPU_NODE, module=STAND_IN)
    opener = ShmOpener()
    client = KvStoreClient(node.address, device_opener=opener)
    try:
        assert await wait_ready(client)
        a, b, c = make_chain(3, FLOATS)
        # a: the engine has no checksum (the node computes it); b: it has one; c: a wrong one
        result = await client.put_device([header(a, 0), header(b), header(c, c.checksum ^ 1)],
                                         [on_device(opener, x) for x in (a, b, c)])
        assert (result.stored, result.rejected) == (2, 1) and client.mover == CUDA_IPC
        assert await gpu_blocks(client) == 2
        listed = await client.list_blocks()
        assert listed is not None and {x.key for x in listed.blocks if x.tier == common_pb2.KV_TIER_GPU} == {a.key, b.key}
        assert node.metric("crescent_kvstore_checksum_failures_total", tier="put") == 1

        rooms = [opener.alloc(a.nbytes).zero_() for _ in range(3)]
        hits = node.metric("crescent_kvstore_hits_total", tier="gpu")
        got = await client.get_device([a.key, b.key, c.key], rooms, a.model_id)
        assert set(got) == {a.key, b.key} and client.mover == CUDA_IPC
        assert bytes(rooms[0].numpy()) == bytes(a.payload) and bytes(rooms[1].numpy()) == bytes(b.payload)
        assert not rooms[2].any()  # a miss leaves its room alone
        assert node.metric("crescent_kvstore_hits_total", tier="gpu") == hits + 2

        host = KvStoreClient(node.address)  # any reader: verified host bytes, the node's CRC
        try:
            read = await host.get([a.key, b.key], a.model_id)
            assert {k: bytes(v.payload) for k, v in read.items()} == {a.key: bytes(a.payload), b.key: bytes(b.payload)}
        finally:
            await host.close()
    finally:
        await client.close()
        opener.close(unlink=True)


class UnopenableOpener(ShmOpener):
    """The engine's memory is on the node's GPU but the node cannot open it (IPC refused there:
    a container without a shared IPC namespace): its regions name no segment."""

    def export(self, tensor: torch.Tensor) -> DeviceRegion:
        region = super().export(tensor)
        return dataclasses.replace(region, handle=b"crescent-no-such-segment")


@pytest.mark.parametrize("why", ["another gpu", "no gpu tier", "ipc refused"])
async def test_device_blocks_the_node_cannot_take_by_ipc_come_through_host_bytes(kvstore_node, why) -> None:
    node = kvstore_node({} if why == "no gpu tier" else GPU_NODE, module=STAND_IN)
    opener = {"another gpu": lambda: ShmOpener("GPU-other"), "no gpu tier": ShmOpener,
              "ipc refused": UnopenableOpener}[why]()
    client = KvStoreClient(node.address, device_opener=opener)
    try:
        assert await wait_ready(client)
        a, b = make_chain(2, FLOATS)
        result = await client.put_device([header(a, 0)], [on_device(opener, a)])
        assert (result.stored, result.rejected) == (1, 0) and client.mover != CUDA_IPC
        assert not client._ladder.allows(node.address, CUDA_IPC)  # refused for this node, for good
        room = opener.alloc(a.nbytes).zero_()
        got = await client.get_device([a.key], [room], a.model_id)
        assert set(got) == {a.key} and bytes(room.numpy()) == bytes(a.payload) and client.mover != CUDA_IPC
        result = await client.put_device([header(b, 0)], [on_device(opener, b)])
        assert result.stored == 1 and client.mover != CUDA_IPC
        if why != "no gpu tier":  # host bytes still land in the GPU tier, the node's first
            assert await gpu_blocks(client) == 2
    finally:
        await client.close()
        opener.close(unlink=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it)")
async def test_device_blocks_go_device_to_device_through_a_real_node_cuda(kvstore_node) -> None:
    node = kvstore_node(GPU_NODE)  # the node's own GPU tier, real CUDA IPC
    client = KvStoreClient(node.address, device_opener=CudaIpc())
    try:
        assert await wait_ready(client)
        a, b = make_chain(2, FLOATS)
        tensors = [torch.frombuffer(bytearray(x.payload), dtype=torch.uint8).cuda() for x in (a, b)]
        result = await client.put_device([header(a, 0), header(b)], tensors)
        assert (result.stored, result.rejected) == (2, 0) and client.mover == CUDA_IPC
        rooms = [torch.zeros(a.nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        got = await client.get_device([a.key, b.key], rooms, a.model_id)
        assert set(got) == {a.key, b.key} and client.mover == CUDA_IPC
        assert [bytes(r.cpu().numpy()) for r in rooms] == [bytes(a.payload), bytes(b.payload)]
        assert await gpu_blocks(client) == 2
    finally:
        await client.close()

