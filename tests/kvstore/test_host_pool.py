"""The host arena's allocator: contiguous runs, merging, and fragmentation handled by eviction."""

from __future__ import annotations

from crescent.services.common.metrics import kvstore_metrics
from crescent.services.kvstore.config import HostTierSettings
from crescent.services.kvstore.host_pool import HostPool
from crescent.services.kvstore.store import TieredStore
from crescent.services.kvstore.tier import HostTier

from .helpers import MODEL, make_chain


def test_runs_are_first_fit_and_merge_back() -> None:
    pool = HostPool(10 * 1024, 1024)
    a, b, c = pool.allocate(3000), pool.allocate(1024), pool.allocate(4000)
    assert (a, b, c) == (0, 3, 4) and pool.free_pages == 2
    assert pool.allocate(3 * 1024) is None
    pool.release(b, 1024)
    pool.release(a, 3000)
    assert pool.largest_run() == 4 and pool.allocate(4096) == 0
    pool.release(0, 4096)
    pool.release(c, 4000)
    assert pool.largest_run() == 10 and pool.free_pages == 10
    assert pool.allocate(0) == 0 and pool.free_pages == 10


def test_views_hold_the_bytes_written() -> None:
    pool = HostPool(8192, 1024)
    start = pool.allocate(5)
    pool.view(start, 5)[:] = b"hello"
    assert bytes(pool.view(start, 5)) == b"hello"


async def test_a_fragmented_tier_evicts_until_a_run_fits() -> None:
    small = make_chain(4, floats=256)  # 1 KiB each
    big = make_chain(1, floats=512, salt=b"big")[0]  # 2 KiB
    tier = HostTier(HostTierSettings(capacity_bytes=4096, page_bytes=1024, high_watermark=1.0, low_watermark=1.0))
    store = TieredStore([tier], kvstore_metrics())
    for block in small:
        assert await store.put(block)
    await store.remove(small[0].key)
    await store.remove(small[2].key)  # 2 KiB free, but in two 1 KiB holes
    assert not tier.pool.can_allocate(2048)
    assert await store.put(big)
    got = await store.get(big.key, MODEL)
    assert got is not None and bytes(got.payload) == bytes(big.payload)
    assert not store.exists(small[1].key) and store.exists(small[3].key)  # LRU: [1] went first
