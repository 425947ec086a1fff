"""The kvstore process over gRPC and shared memory, as prefill would use it."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvstore.config import load_kvstore_settings
from crescent.services.common.settings import SettingsError

from .conftest import free_port
from .helpers import MODEL, make_chain

KIB = 1024


@pytest.mark.parametrize("path", ["grpc", "tcp", "shm-pool", "shm-segment"])
@pytest.mark.slow
async def test_put_then_get_prefix_exists_remove_stat(kvstore_node, path: str) -> None:
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 64 << 20}}})
    mover = path.split("-")[0]
    client = KvStoreClient(node.address, movers=[mover])
    if path == "shm-segment":
        client.shared_memory._pool_unusable = True  # as a client that cannot open the node's pool
    try:
        chain = make_chain(4, floats=1 << 20)  # 4 MiB blocks: more than one gRPC chunk with headers
        big = make_chain(1, floats=(9 << 20) // 4, salt=b"big")[0]
        result = await client.put([*chain[:3], big])
        assert (result.stored, result.rejected, result.failed) == (4, 0, False)
        prefix = await client.get_prefix([b.key for b in chain], MODEL, lease_ms=1000)
        assert [b.key for b in prefix] == [b.key for b in chain[:3]]
        assert all(bytes(got.payload) == bytes(want.payload) for got, want in zip(prefix, chain))
        got_big = await client.get([big.key], MODEL)
        assert bytes(got_big[big.key].payload) == bytes(big.payload)
        assert await client.exists([chain[0].key, chain[3].key]) == [True, False]
        assert await client.remove([chain[1].key, chain[3].key]) == 1
        prefix = await client.get_prefix([b.key for b in chain], MODEL)
        assert [b.key for b in prefix] == [chain[0].key]  # stops at the removed block
        stat = await client.stat()
        assert stat is not None and stat.node_id == "node-a"
        host = stat.tiers[0]
        assert host.blocks == 3 and host.bytes == 2 * (4 << 20) + big.nbytes and host.capacity_bytes == 64 << 20
        assert node.metric("crescent_kvstore_blocks", tier="host") == 3
    finally:
        await client.close()
    assert client.mover == mover, "the blocks moved the way asked"
    assert client.uses_shared_memory == (mover == "shm")
    if mover == "shm":
        assert (client.shared_memory._pool_path != "") == (path == "shm-pool")  # reads came straight from the pool
    assert not client.errors


@pytest.mark.slow
async def test_wrong_model_or_corrupt_blocks_are_misses(kvstore_node) -> None:
    node = kvstore_node()
    client = KvStoreClient(node.address)
    try:
        a, b = make_chain(2)
        bad = dataclasses.replace(b, checksum=b.checksum ^ 1)
        result = await client.put([a, bad])
        assert (result.stored, result.rejected) == (1, 1)
        assert await client.get_prefix([a.key, b.key], "another-model") == []
        assert [x.key for x in await client.get_prefix([a.key, b.key], MODEL)] == [a.key]
    finally:
        await client.close()


async def test_an_unreachable_store_is_a_miss_not_an_error() -> None:
    client = KvStoreClient(f"127.0.0.1:{free_port()}", timeout_s=1.0)
    try:
        chain = make_chain(2)
        assert await client.get_prefix([b.key for b in chain], MODEL) == []
        result = await client.put(chain)
        assert result.failed and result.stored == 0
        assert await client.exists([chain[0].key]) == [False]
        assert await client.stat() is None
        assert client.errors["get"] == 1 and client.errors["put"] == 1
    finally:
        await client.close()


@pytest.mark.slow
async def test_leased_blocks_survive_concurrent_puts(kvstore_node) -> None:
    block_bytes = 64 * KIB
    node = kvstore_node({"tiers": {"host": {"capacity_bytes": 8 * block_bytes, "page_bytes": block_bytes,
                                            "high_watermark": 1.0, "low_watermark": 1.0}}})
    clients = [KvStoreClient(node.address) for _ in range(4)]
    try:
        hot = make_chain(3, floats=block_bytes // 4, salt=b"hot")
        await clients[0].put(hot)
        held = await clients[0].get_prefix([b.key for b in hot], MODEL, lease_ms=30_000)
        assert len(held) == 3

        async def churn(client: KvStoreClient, i: int) -> None:
            for j in range(6):
                await client.put(make_chain(2, floats=block_bytes // 4, salt=f"{i}-{j}".encode()))
                got = await client.get_prefix([b.key for b in hot], MODEL)
                assert len(got) == 3, "a leased block was evicted"

        await asyncio.gather(*(churn(c, i) for i, c in enumerate(clients)))
        stat = await clients[0].stat()
        assert stat.tiers[0].evictions > 0 and stat.leased_blocks == 3
        assert stat.tiers[0].bytes <= 8 * block_bytes
    finally:
        for c in clients:
            await c.close()


@pytest.mark.slow
def test_sigterm_stops_the_node_cleanly(kvstore_node) -> None:
    node = kvstore_node()
    assert node.stop() == 0
    assert "stopped" in node.log.read_text()


def test_settings_errors_name_the_setting(tmp_path, monkeypatch) -> None:
    with pytest.raises(SettingsError, match="valid: lru, s3fifo"):
        load_kvstore_settings(environ={"CRESCENT_KVSTORE__EVICTION_POLICY": "mru"})
    with pytest.raises(SettingsError, match="tiers.disk"):
        load_kvstore_settings(environ={"CRESCENT_KVSTORE__TIERS__DISK__ENABLED": "true"})
    settings = load_kvstore_settings(environ={"CRESCENT_KVSTORE__TIERS__HOST__CAPACITY_BYTES": "1048576"})
    assert settings.tiers.host.capacity_bytes == 1 << 20
    with pytest.raises(SettingsError, match="tiers.host.page_bytes"):
        load_kvstore_settings(environ={"CRESCENT_KVSTORE__TIERS__HOST__CAPACITY_BYTES": "1234"})
