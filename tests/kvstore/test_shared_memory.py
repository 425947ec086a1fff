"""Same-host puts straight into the node's pool, and what keeps them safe: room given back when
a writer goes away, corruption caught by readers, broken or malformed streams refused."""

from __future__ import annotations

import asyncio
import mmap
import time

import grpc
import pytest

from crescent.protos import common_pb2, kvstore_pb2
from crescent.services.kvwire import chunk_wire
from crescent.services.common.grpc_service import open_channel
from crescent.services.kvwire.kv_block import meta_of
from crescent.services.kvstore.client import KvStoreClient

from .helpers import MODEL, make_chain

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)

MIB = 1 << 20


async def host_reserved(client: KvStoreClient) -> int:
    stat = await client.stat()
    assert stat is not None
    return next(t.reserved_bytes for t in stat.tiers if t.tier == common_pb2.KV_TIER_HOST)


class CallCounter:
    """Counts calls of one client RPC and passes them on."""

    def __init__(self, client: KvStoreClient, name: str) -> None:
        self.calls, self._inner = 0, getattr(client._stub, name)
        setattr(client._stub, name, self)

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        self.calls += 1
        return self._inner(*args, **kwargs)


async def test_puts_of_one_shape_take_one_round_trip_and_give_room_back_on_close(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 64 * MIB}}})
    writer = KvStoreClient(node.address, shared_memory=True)
    reader = KvStoreClient(node.address, movers=["grpc"])  # plain gRPC: checks what landed in the pool
    reserves = CallCounter(writer, "ReserveShm")
    try:
        first, second = make_chain(3, floats=MIB // 4, salt=b"1"), make_chain(3, floats=MIB // 4, salt=b"2")
        assert (await writer.put(first)).stored == 3
        assert reserves.calls == 1 and await host_reserved(reader) == 3 * MIB  # room held for the next put
        assert (await writer.put(second)).stored == 3
        assert reserves.calls == 1  # the room was there: commit only
        for chain in (first, second):
            got = await reader.get_prefix([b.key for b in chain], MODEL)
            assert [bytes(b.payload) for b in got] == [bytes(b.payload) for b in chain]
        assert (await writer.put(first[:1])).stored == 1  # held already: nothing copied, still stored
        assert reserves.calls == 2  # another shape: the held room went back, new room reserved
    finally:
        await writer.close()
    try:
        assert await host_reserved(reader) == 0
        assert node.metric("crescent_kvstore_blocks", tier="host") == 6
    finally:
        await reader.close()
    assert not writer.errors and not reader.errors


async def test_room_a_writer_never_commits_is_given_back(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 8 * MIB}}, "shm_reservation_ms": 200})
    client = KvStoreClient(node.address, shared_memory=True)
    try:
        blocks = make_chain(6, floats=MIB // 4)
        reply = await client._stub.ReserveShm(kvstore_pb2.ShmReserveRequest(blocks=[b.to_meta() for b in blocks]))
        assert all(slot.granted for slot in reply.slots) and await host_reserved(client) == 6 * MIB
        deadline = time.monotonic() + 10
        while await host_reserved(client) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert await host_reserved(client) == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a commit after that is refused
            await client._stub.CommitShm(kvstore_pb2.ShmCommitRequest(reservation=reply.reservation, written=[True] * 6))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert (await client.put(blocks)).stored == 6  # the room is usable again
    finally:
        await client.close()
    assert "gave back 6 reserved pool blocks" in node.log.read_text()


@pytest.mark.parametrize("path", ["shm", "tcp", "grpc"])
async def test_a_block_corrupted_in_the_pool_is_a_miss_then_dropped_and_stored_again(kvstore_node, path: str) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    writer = KvStoreClient(node.address, shared_memory=True)
    reader = KvStoreClient(node.address, movers=[path])
    try:
        a, b = make_chain(2, floats=MIB // 4)
        assert (await writer.put([a, b])).stored == 2
        # A stray write into b's bytes, as a buggy same-host process could do.
        listing = await writer.get([b.key], MODEL)
        assert bytes(listing[b.key].payload) == bytes(b.payload)
        pool = writer.shared_memory._pool_view
        assert pool is not None
        with open(writer.shared_memory._pool_path, "rb") as f:
            whole = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            offset = whole.find(bytes(b.payload[:4096]))
            whole.close()
        assert offset >= 0
        pool[offset + 100] ^= 0xFF
        got = await reader.get_prefix([a.key, b.key], MODEL)
        assert [x.key for x in got] == [a.key]  # b is a miss, never wrong bytes
        assert reader.errors["integrity"] == 1
        # The reader told the node: the bad copy is counted for host memory and dropped, so the
        # next put of b stores it again instead of the prefix recomputing forever.
        assert node.metric("crescent_kvstore_checksum_failures_total", tier="host") == 1
        assert await reader.exists([a.key, b.key]) == [True, False]
        assert (await writer.put([b])).stored == 1
        got = await reader.get_prefix([a.key, b.key], MODEL)
        assert [bytes(x.payload) for x in got] == [bytes(a.payload), bytes(b.payload)]
    finally:
        await writer.close()
        await reader.close()


async def test_a_put_stream_cut_inside_a_block_gives_its_room_back(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 8 * MIB, "high_watermark": 1.0, "low_watermark": 1.0}}})
    client = KvStoreClient(node.address)
    channel = open_channel(node.address, None)
    put = channel.stream_unary("/crescent.v1.KvStore/Put", request_serializer=chunk_wire.encode_chunk,
                               response_deserializer=kvstore_pb2.PutReply.FromString)
    try:
        block = make_chain(1, floats=2 * MIB)[0]  # 8 MiB: the whole tier
        chunks = list(chunk_wire.block_chunks(meta_of(block), block.payload, MIB))

        async def first_half():
            for chunk in chunks[:4]:
                yield chunk

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await put(first_half())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inside a block" in err.value.details()
        assert await host_reserved(client) == 0
        assert (await client.put([block])).stored == 1  # all of the tier is free again
    finally:
        await channel.close()
        await client.close()


async def test_malformed_chunk_bytes_are_refused_and_the_node_keeps_serving(kvstore_node) -> None:
    node = kvstore_node()
    channel = open_channel(node.address, None)
    raw_put = channel.stream_unary("/crescent.v1.KvStore/Put", request_serializer=lambda b: b,
                                   response_deserializer=kvstore_pb2.PutReply.FromString)
    client = KvStoreClient(node.address)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw_put(iter([b"\x12\x50abc"]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed BlockChunk" in err.value.details()
        chain = make_chain(2)
        assert (await client.put(chain)).stored == 2
        assert len(await client.get_prefix([b.key for b in chain], MODEL)) == 2
    finally:
        await channel.close()
        await client.close()


async def test_a_pool_path_naming_another_file_here_is_never_written(kvstore_node, tmp_path) -> None:
    """As when the node is on another host (or PID namespace) where /proc/<pid>/fd/<n> names
    some other process's file: the client checks the file's identity and uses gRPC instead."""
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 16 * MIB}}})
    decoy = tmp_path / "someone-elses-file"
    decoy.write_bytes(bytes(16 * MIB))
    client = KvStoreClient(node.address, shared_memory=True)
    real_reserve = client._stub.ReserveShm

    async def reserve_elsewhere(request, **kwargs):  # noqa: ANN001, ANN003, ANN202
        reply = await real_reserve(request, **kwargs)
        reply.pool_path = str(decoy)
        return reply

    client._stub.ReserveShm = reserve_elsewhere
    try:
        chain = make_chain(3, floats=MIB // 4)
        assert (await client.put(chain)).stored == 3
        assert decoy.read_bytes() == bytes(16 * MIB)
        got = await client.get_prefix([b.key for b in chain], MODEL)
        assert [bytes(b.payload) for b in got] == [bytes(b.payload) for b in chain]
        assert await host_reserved(client) == 0  # the unused room went back
    finally:
        await client.close()


async def test_concurrent_first_calls_share_one_pool_mapping(kvstore_node) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 64 * MIB}}})
    client = KvStoreClient(node.address, shared_memory=True)
    try:
        chains = [make_chain(2, floats=MIB // 4, salt=bytes([i])) for i in range(6)]
        results = await asyncio.gather(*(client.put(chain) for chain in chains))
        assert [r.stored for r in results] == [2] * 6
        reads = await asyncio.gather(*(client.get_prefix([b.key for b in chain], MODEL) for chain in chains))
        for chain, got in zip(chains, reads):
            assert [bytes(b.payload) for b in got] == [bytes(b.payload) for b in chain]
        assert client.shared_memory._pool_view is not None and not client.errors
    finally:
        await client.close()
