"""The GPU tier above host memory (needs CUDA; skipped otherwise)."""

from __future__ import annotations

import pytest

from crescent.services.common.metrics import kvstore_metrics
from crescent.services.kvstore.config import GpuTierSettings, HostTierSettings
from crescent.services.kvstore.gpu_tier import cuda_available
from crescent.services.kvstore.store import TieredStore
from crescent.services.kvstore.tier import HostTier

from .helpers import MODEL, make_chain

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CUDA")]

BLOCK = 1024


async def test_blocks_demote_from_gpu_to_host_and_promote_back() -> None:
    from crescent.services.kvstore.gpu_tier import GpuTier

    exact = {"high_watermark": 1.0, "low_watermark": 1.0}
    gpu = GpuTier(GpuTierSettings(enabled=True, capacity_bytes=2 * BLOCK, **exact))
    host = HostTier(HostTierSettings(capacity_bytes=8 * BLOCK, page_bytes=BLOCK, **exact), pinned=True)
    store = TieredStore([gpu, host], kvstore_metrics())
    chain = make_chain(4)
    for block in chain:
        assert await store.put(block)
    assert [store.location(b.key) for b in chain] == [1, 1, 0, 0]
    got = await store.get(chain[0].key, MODEL)
    assert got is not None and bytes(got.payload) == bytes(chain[0].payload)
    assert store.location(chain[0].key) == 0
    got = await store.get(chain[3].key, MODEL)
    assert got is not None and bytes(got.payload) == bytes(chain[3].payload)


async def test_a_corrupt_gpu_copy_is_counted_dropped_and_read_from_host() -> None:
    from crescent.services.kvstore.gpu_tier import GpuTier

    exact = {"high_watermark": 1.0, "low_watermark": 1.0}
    gpu = GpuTier(GpuTierSettings(enabled=True, capacity_bytes=2 * BLOCK, **exact))
    host = HostTier(HostTierSettings(capacity_bytes=8 * BLOCK, page_bytes=BLOCK, **exact), pinned=True)
    store = TieredStore([gpu, host], kvstore_metrics(), write_through=True)
    (a,) = make_chain(1)
    assert await store.put(a) and store.location(a.key) == 0 and a.key in host
    gpu._blocks[a.key][1][10] ^= 0xFF  # a bit flip in device memory
    failures = kvstore_metrics().checksum_failures.labels("gpu")._value.get()
    got = await store.get(a.key, MODEL)
    assert got is not None and bytes(got.payload) == bytes(a.payload)  # the intact host copy
    assert kvstore_metrics().checksum_failures.labels("gpu")._value.get() == failures + 1
    promoted = await gpu.read(a.key)  # the bad copy was dropped, the good one promoted back
    assert promoted is not None and bytes(promoted.payload) == bytes(a.payload)
