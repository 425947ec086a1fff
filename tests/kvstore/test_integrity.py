"""Corruption on every tier of the store as a library: counted for that tier, the bad copy
dropped and announced as gone, and the block stored again by the next put."""

from __future__ import annotations

from crescent.protos import common_pb2
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.common.metrics import kvstore_metrics
from crescent.services.kvstore.store import TieredStore
from crescent.services.kvstore.tier import HostTier

from .helpers import MODEL, make_chain
from .test_store import disk, host


def failures(tier: str) -> float:
    return kvstore_metrics().checksum_failures.labels(tier)._value.get()


def flip_byte_in_pool(tier: HostTier, block: KvBlock) -> None:
    """A stray write into the block's bytes, as a buggy same-host process could make."""
    offset = tier.pool_offset(block.key)
    assert offset is not None
    tier.pool.buf[offset + 10] ^= 0xFF


def removed(events: list[common_pb2.BlockEvent], block: KvBlock) -> bool:
    return any(e.key == block.key and e.kind == common_pb2.BLOCK_EVENT_REMOVED for e in events)


async def test_a_reader_reported_corrupt_host_block_is_counted_dropped_and_stored_again() -> None:
    tier = host(4)
    store = TieredStore([tier], kvstore_metrics())
    events: list[common_pb2.BlockEvent] = []
    store.subscribe(events.append)
    a, b = make_chain(2)
    assert await store.put(a) and await store.put(b)
    flip_byte_in_pool(tier, b)
    before = failures("host")
    assert not await store.recheck(a.key)  # intact: a false report drops nothing
    assert await store.recheck(b.key)
    assert failures("host") == before + 1
    assert store.exists(a.key) and not store.exists(b.key) and removed(events, b)
    assert tier.pool.free_pages == 3  # its pages went back
    assert await store.put(b)
    got = await store.get(b.key, MODEL, verify=True)
    assert got is not None and bytes(got.payload) == bytes(b.payload)


async def test_a_corrupt_host_block_is_never_demoted(tmp_path) -> None:
    tier = host(1)
    store = TieredStore([tier, disk(tmp_path, 4)], kvstore_metrics())
    events: list[common_pb2.BlockEvent] = []
    store.subscribe(events.append)
    a, b = make_chain(2)
    assert await store.put(a)
    flip_byte_in_pool(tier, a)
    before = failures("host")
    assert await store.put(b)  # evicts a: checked before it would be written to disk
    assert failures("host") == before + 1
    assert not store.exists(a.key) and removed(events, a)
    assert not store.tiers[1].path_of(a.key).exists()


async def test_a_host_block_sent_elsewhere_is_verified_first() -> None:
    tier = host(2)
    store = TieredStore([tier], kvstore_metrics())
    (a,) = make_chain(1)
    assert await store.put(a)
    flip_byte_in_pool(tier, a)
    assert await store.get(a.key) is not None  # plain reads leave the check to the reader
    before = failures("host")
    assert await store.get(a.key, verify=True) is None
    assert failures("host") == before + 1 and not store.exists(a.key)


async def test_unreadable_disk_files_found_at_start_are_counted(tmp_path) -> None:
    first = disk(tmp_path, 4)
    await first.start()
    (a,) = make_chain(1)
    assert await first.write(a)
    path = first.path_of(a.key)
    path.write_bytes(b"CKVB\xff\xff\xff\xff" + path.read_bytes()[8:])  # a header length past the limit
    again = disk(tmp_path, 4)
    await again.start()
    before = failures("disk")
    store = TieredStore([host(1), again], kvstore_metrics())
    assert failures("disk") == before + 1
    assert not store.exists(a.key) and not path.exists()
    assert await store.put(a) and store.exists(a.key)
