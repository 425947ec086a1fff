"""The tiered store as a library: eviction order, leases, demotion/promotion, corruption."""

from __future__ import annotations

import dataclasses

import pytest

from crescent.protos import common_pb2
from crescent.services.common.metrics import kvstore_metrics
from crescent.services.kvstore.config import DiskTierSettings, HostTierSettings
from crescent.services.kvstore.disk_tier import DiskTier
from crescent.services.kvstore.eviction import LruPolicy, S3FifoPolicy, make_eviction_policy
from crescent.services.kvstore.store import TieredStore
from crescent.services.kvstore.tier import HostTier

from .helpers import MODEL, make_chain

BLOCK = 1024  # payload bytes of make_chain(n, floats=256)


def host(blocks: int) -> HostTier:
    return HostTier(HostTierSettings(capacity_bytes=blocks * BLOCK, page_bytes=BLOCK, high_watermark=1.0, low_watermark=1.0))


def disk(path, blocks: int) -> DiskTier:
    return DiskTier(
        DiskTierSettings(enabled=True, path=path, capacity_bytes=blocks * BLOCK, high_watermark=1.0, low_watermark=1.0)
    )


async def test_lru_evicts_least_recently_used_and_never_a_leased_block() -> None:
    store = TieredStore([host(3)], kvstore_metrics())
    a, b, c, d, e = make_chain(5)
    for block in (a, b, c):
        assert await store.put(block)
    assert await store.get(a.key, MODEL, lease_ms=60_000) is not None  # a: recent and leased
    assert await store.put(d)  # evicts b, the least recently used
    assert [store.exists(x.key) for x in (a, b, c, d)] == [True, False, True, True]
    await store.get(c.key)  # now a (leased) is the oldest: e must evict d instead
    assert await store.put(e)
    assert [store.exists(x.key) for x in (a, c, d, e)] == [True, True, False, True]


async def test_a_put_fails_when_every_block_is_leased() -> None:
    store = TieredStore([host(2)], kvstore_metrics())
    a, b, c = make_chain(3)
    await store.put(a), await store.put(b)
    await store.get(a.key, lease_ms=60_000), await store.get(b.key, lease_ms=60_000)
    assert not await store.put(c)
    assert store.exists(a.key) and store.exists(b.key)


async def test_watermarks_free_down_to_the_low_mark() -> None:
    tier = HostTier(HostTierSettings(capacity_bytes=10 * BLOCK, page_bytes=BLOCK, high_watermark=0.9, low_watermark=0.5))
    store = TieredStore([tier], kvstore_metrics())
    for block in make_chain(10):
        assert await store.put(block)
    assert tier.used_bytes <= 10 * BLOCK and len(tier) < 10
    assert tier.used_bytes >= 5 * BLOCK


async def test_evicted_blocks_demote_to_disk_and_hits_promote_back(tmp_path) -> None:
    events: list[common_pb2.BlockEvent] = []
    store = TieredStore([host(2), disk(tmp_path, 10)], kvstore_metrics())
    store.subscribe(events.append)
    chain = make_chain(4)
    for block in chain:
        assert await store.put(block)
    assert [store.location(b.key) for b in chain] == [1, 1, 0, 0]
    got = await store.get(chain[0].key, MODEL)
    assert got is not None and bytes(got.payload) == bytes(chain[0].payload)
    assert store.location(chain[0].key) == 0  # promoted
    kinds = [(e.kind, e.tier) for e in events if e.key == chain[0].key]
    assert kinds == [
        (common_pb2.BLOCK_EVENT_STORED, common_pb2.KV_TIER_HOST),
        (common_pb2.BLOCK_EVENT_TIER_CHANGED, common_pb2.KV_TIER_DISK),
        (common_pb2.BLOCK_EVENT_TIER_CHANGED, common_pb2.KV_TIER_HOST),
    ]
    assert events[0].parent_key == b"" and events[1].parent_key == chain[0].key


async def test_corrupt_disk_copy_is_a_miss_and_is_deleted(tmp_path) -> None:
    store = TieredStore([host(1), disk(tmp_path, 10)], kvstore_metrics())
    a, b = make_chain(2)
    await store.put(a), await store.put(b)  # a is demoted to disk
    path = store.tiers[1].path_of(a.key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    failures = kvstore_metrics().checksum_failures.labels("disk")._value.get()
    assert await store.get(a.key, MODEL) is None
    assert kvstore_metrics().checksum_failures.labels("disk")._value.get() == failures + 1
    assert not path.exists() and not store.exists(a.key)


async def test_disk_tier_is_reindexed_after_a_restart(tmp_path) -> None:
    chain = make_chain(3)
    first = disk(tmp_path, 10)
    await first.start()
    store = TieredStore([first], kvstore_metrics())
    for block in chain:
        await store.put(block)
    (tmp_path / "zz").mkdir()
    (tmp_path / "zz" / "junk.kvb").write_bytes(b"not a block")
    again = disk(tmp_path, 10)
    await again.start()
    store = TieredStore([again], kvstore_metrics())
    for block in chain:
        got = await store.get(block.key, MODEL)
        assert got is not None and bytes(got.payload) == bytes(block.payload)
    assert again.used_bytes == 3 * BLOCK and not (tmp_path / "zz" / "junk.kvb").exists()


async def test_full_disk_counts_as_full(tmp_path, monkeypatch) -> None:
    import errno
    import os

    tier = disk(tmp_path, 100)
    store = TieredStore([tier], kvstore_metrics())
    a, b = make_chain(2)
    assert await store.put(a)
    real_writev = os.writev

    def no_space(fd, parts):  # what a full filesystem answers
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", no_space)
    assert not await store.put(b)
    assert tier.effective_capacity() == BLOCK
    monkeypatch.setattr(os, "writev", real_writev)
    assert await store.put(b)  # room is made by evicting a, and the tier takes writes again
    assert store.exists(b.key)


async def test_write_through_copies_every_put_down(tmp_path) -> None:
    store = TieredStore([host(4), disk(tmp_path, 10)], kvstore_metrics(), write_through=True)
    (a,) = make_chain(1)
    await store.put(a)
    assert a.key in store.tiers[0] and a.key in store.tiers[1]


async def test_put_rejects_a_corrupt_block() -> None:
    store = TieredStore([host(4)], kvstore_metrics())
    (a,) = make_chain(1)
    assert not await store.put(dataclasses.replace(a, checksum=a.checksum ^ 1))
    assert not store.exists(a.key)


def test_s3fifo_keeps_blocks_read_again_over_one_hit_wonders() -> None:
    policy = make_eviction_policy("s3fifo")
    keys = [bytes([i]) * 16 for i in range(20)]
    for key in keys[:10]:
        policy.insert(key)
    for key in keys[:10]:
        policy.touch(key)  # read again: these are worth keeping
    for key in keys[10:]:
        policy.insert(key)  # a scan of blocks seen once
    victims = [policy.pop_victim(lambda k: False) for _ in range(10)]
    assert set(victims) == set(keys[10:])


def test_unknown_policy_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: lru, s3fifo"):
        make_eviction_policy("fifo")


async def test_blocks_written_in_place_are_stored_once_committed() -> None:
    tier = host(4)
    store = TieredStore([tier], kvstore_metrics())
    a, b = make_chain(2)
    room = await store.reserve(a.nbytes)
    assert room is not None and tier.reserved_bytes == a.nbytes and not store.exists(a.key)
    room.view[:] = a.payload
    stored = dataclasses.replace(a, payload=room.view.toreadonly())
    assert await store.commit(stored, room)
    assert tier.reserved_bytes == 0 and tier.used_bytes == a.nbytes
    got = await store.get(a.key, MODEL)
    assert got is not None and bytes(got.payload) == bytes(a.payload)
    # A corrupt block is refused and its room given back.
    room = await store.reserve(b.nbytes)
    room.view[:] = bytes(b.nbytes)
    assert not await store.commit(dataclasses.replace(b, payload=room.view.toreadonly()), room)
    assert not store.exists(b.key) and tier.reserved_bytes == 0 and tier.pool.free_pages == 3


async def test_reserved_room_is_never_evicted_and_spare_room_never_evicts() -> None:
    tier = host(3)
    store = TieredStore([tier], kvstore_metrics())
    a, b, c, d = make_chain(4)
    for block in (a, b, c):
        assert await store.put(block)
    assert await store.reserve(BLOCK, spare_only=True) is None  # only by evicting: refused
    assert all(store.exists(x.key) for x in (a, b, c))
    room = await store.reserve(BLOCK)  # a real put's room: evicts the oldest block
    assert room is not None and not store.exists(a.key)
    assert await store.put(d)  # evicts another block, never the room
    assert tier.reserved_bytes == BLOCK and tier.used_bytes == 2 * BLOCK and store.exists(d.key)
    store.release(room)
    assert tier.reserved_bytes == 0 and tier.pool.free_pages == 1
    assert await store.reserve(4 * BLOCK) is None  # more than the tier holds


async def test_reserve_needs_host_memory_first(tmp_path) -> None:
    store = TieredStore([disk(tmp_path, 4)], kvstore_metrics())  # as when a GPU tier comes first
    assert await store.reserve(BLOCK) is None


def test_policies_name_the_blocks_they_would_keep_longest_first() -> None:
    lru, s3fifo = LruPolicy(), S3FifoPolicy()
    keys = [bytes([i]) * 32 for i in range(4)]
    for policy in (lru, s3fifo):
        for key in keys:
            policy.insert(key)
        policy.touch(keys[1])  # read again
    assert lru.keep_order() == [keys[1], keys[3], keys[2], keys[0]]
    assert s3fifo.keep_order()[0] == keys[1] and sorted(s3fifo.keep_order()) == sorted(keys)
