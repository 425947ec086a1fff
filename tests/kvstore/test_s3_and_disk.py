"""Host -> disk -> S3 against a real S3 server (moto, its own process): demotion, promotion,
corruption, outage, restart recovery."""

from __future__ import annotations

import asyncio

import boto3
import pytest

from crescent.services.kvstore.client import KvStoreClient

from .conftest import s3_config
from .helpers import MODEL, make_chain

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)

BLOCK = 64 * 1024


def tiers(tmp_path, s3_server, host_blocks: int = 2, disk_blocks: int = 2, **s3_extra) -> dict:
    exact = {"high_watermark": 1.0, "low_watermark": 1.0}
    return {
        "tiers": {
            "host": {"capacity_bytes": host_blocks * BLOCK, "page_bytes": 16 * 1024, **exact},
            "disk": {"enabled": True, "path": str(tmp_path / "disk"), "capacity_bytes": disk_blocks * BLOCK, **exact},
            "s3": s3_config(s3_server, **s3_extra),
        }
    }


def s3_client(s3_server):
    return boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def s3_objects(s3_server) -> dict[str, bytes]:
    s3 = s3_client(s3_server)
    try:
        listed = s3.list_objects_v2(Bucket="kv-test", Prefix="blocks/").get("Contents", [])
    except s3.exceptions.NoSuchBucket:
        return {}  # the node has not created it yet
    return {o["Key"]: s3.get_object(Bucket="kv-test", Key=o["Key"])["Body"].read() for o in listed}


async def wait_for(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def locations(client: KvStoreClient) -> dict[bytes, int]:
    listed = await client.list_blocks()
    return {b.key: b.tier for b in listed.blocks}


@pytest.mark.slow
async def test_blocks_demote_through_every_tier_and_promote_back(tmp_path, s3_server, kvstore_node) -> None:
    node = kvstore_node(tiers(tmp_path, s3_server))
    client = KvStoreClient(node.address)
    try:
        chain = make_chain(6, floats=BLOCK // 4)
        for block in chain:  # one at a time, so eviction order is the put order
            assert (await client.put([block])).stored == 1
        where = await locations(client)
        assert [where[b.key] for b in chain] == [4, 4, 3, 3, 2, 2]  # S3, S3, disk, disk, host, host
        await wait_for(lambda: len(s3_objects(s3_server)) == 2)
        # Reading the two oldest blocks promotes them from S3 back into host memory.
        oldest = await client.get_prefix([b.key for b in chain[:2]], MODEL)
        assert [bytes(b.payload) for b in oldest] == [bytes(b.payload) for b in chain[:2]]
        assert node.metric("crescent_kvstore_promotions_total", tier="s3") >= 1
        assert node.metric("crescent_kvstore_hits_total", tier="s3") >= 1
        assert node.metric("crescent_kvstore_demotions_total", tier="disk") >= 2
        where = await locations(client)
        assert where[chain[1].key] == 2  # the last block read is in host memory again
        # A whole-prefix read larger than host memory still returns every block intact: blocks
        # not yet read are pinned, so promotions cannot push them out mid-read.
        prefix = await client.get_prefix([b.key for b in chain], MODEL)
        assert [bytes(b.payload) for b in prefix] == [bytes(b.payload) for b in chain]
    finally:
        await client.close()


@pytest.mark.slow
async def test_corrupt_copies_on_disk_and_s3_are_counted_dropped_and_stored_again(tmp_path, s3_server, kvstore_node) -> None:
    node = kvstore_node(tiers(tmp_path, s3_server, host_blocks=1, disk_blocks=1))
    client = KvStoreClient(node.address)
    try:
        chain = make_chain(3, floats=BLOCK // 4)
        for block in chain:
            await client.put([block])
        await wait_for(lambda: len(s3_objects(s3_server)) == 1)
        s3 = s3_client(s3_server)
        (name, data), = s3_objects(s3_server).items()
        s3.put_object(Bucket="kv-test", Key=name, Body=data[:-1] + bytes([data[-1] ^ 1]))
        disk_file = next((tmp_path / "disk").glob("*/*.kvb"))
        raw = bytearray(disk_file.read_bytes())
        raw[-1] ^= 1
        disk_file.write_bytes(bytes(raw))
        got = await client.get([b.key for b in chain], MODEL)
        assert set(got) == {chain[2].key}  # only the host copy was intact
        assert node.metric("crescent_kvstore_checksum_failures_total", tier="s3") == 1
        assert node.metric("crescent_kvstore_checksum_failures_total", tier="disk") == 1
        assert await client.exists([chain[0].key, chain[1].key]) == [False, False]
        # Gone from the index too: the next put of each stores it again.
        assert (await client.put(chain[:2])).stored == 2
        again = await client.get([b.key for b in chain[:2]], MODEL)
        assert {k: bytes(b.payload) for k, b in again.items()} == {b.key: bytes(b.payload) for b in chain[:2]}
    finally:
        await client.close()


@pytest.mark.slow
async def test_s3_outage_means_misses_and_dropped_writes_and_the_node_stays_up(tmp_path, s3_server, kvstore_node) -> None:
    node = kvstore_node(tiers(tmp_path, s3_server, host_blocks=1, disk_blocks=1, write_queue_blocks=2))
    client = KvStoreClient(node.address)
    try:
        first = make_chain(3, floats=BLOCK // 4, salt=b"before")
        for block in first:
            await client.put([block])
        await wait_for(lambda: len(s3_objects(s3_server)) == 1)
        s3_server.stop()
        assert await client.get_prefix([first[0].key], MODEL) == []  # in S3 only: a miss, quickly
        for block in make_chain(8, floats=BLOCK // 4, salt=b"during"):
            assert (await client.put([block])).failed is False
        await wait_for(lambda: node.metric("crescent_kvstore_dropped_writes_total", tier="s3") >= 1)
        assert node.metric("crescent_kvstore_s3_errors_total", operation="get") >= 1
        stat = await client.stat()
        assert stat is not None and node.proc.poll() is None
        s3_server.start()  # S3 is back (moto forgets everything: recreate the bucket)
        s3_client(s3_server).create_bucket(Bucket="kv-test")
        await asyncio.sleep(2.5)  # uploads already under way fail by their 1 s timeout
        late = make_chain(3, floats=BLOCK // 4, salt=b"after")
        for block in late:
            await client.put([block])
        await wait_for(lambda: len(s3_objects(s3_server)) >= 1)  # demotions reach S3 again
        assert len(await client.get_prefix([b.key for b in late], MODEL)) == 3
    finally:
        await client.close()


@pytest.mark.slow
async def test_a_restarted_node_finds_its_disk_and_s3_blocks(tmp_path, s3_server, kvstore_node) -> None:
    config = {**tiers(tmp_path, s3_server, host_blocks=1, disk_blocks=2), "spill_on_stop_s": 0}  # the host copy dies
    node = kvstore_node(config, name="first")
    client = KvStoreClient(node.address)
    chain = make_chain(5, floats=BLOCK // 4)
    try:
        for block in chain:
            await client.put([block])
        await wait_for(lambda: len(s3_objects(s3_server)) == 2)
    finally:
        await client.close()
    assert node.stop() == 0
    node = kvstore_node(config, name="second")
    client = KvStoreClient(node.address)
    try:
        await asyncio.sleep(0.3)  # the S3 listing runs in the background
        prefix = await client.get_prefix([b.key for b in chain], MODEL)
        # The host copy is gone with the process; everything on disk and S3 came back.
        assert [b.key for b in prefix] == [b.key for b in chain[:4]]
        assert [bytes(b.payload) for b in prefix] == [bytes(b.payload) for b in chain[:4]]
    finally:
        await client.close()


async def test_a_stopping_node_spills_its_host_blocks_to_disk_hottest_first(tmp_path, kvstore_node) -> None:
    """A rollout replaces the pod: what only host memory held comes back from the SSD tier,
    the blocks read most recently first when the SSD tier cannot take them all."""
    exact = {"high_watermark": 1.0, "low_watermark": 1.0}
    config = {"tiers": {"host": {"capacity_bytes": 4 * BLOCK, "page_bytes": 16 * 1024, **exact},
                        "disk": {"enabled": True, "path": str(tmp_path / "disk"), "capacity_bytes": 2 * BLOCK, **exact}}}
    node = kvstore_node(config, name="first")
    client = KvStoreClient(node.address)
    chain = make_chain(4, floats=BLOCK // 4)
    try:
        assert (await client.put(chain)).stored == 4  # all in host memory: nothing written below yet
        assert len(await client.get_prefix([chain[0].key, chain[1].key], MODEL)) == 2  # read last: kept longest
        assert node.metric("crescent_kvstore_blocks", tier="disk") == 0
    finally:
        await client.close()
    assert node.stop() == 0
    assert "spilled 2 blocks" in node.log.read_text()
    node = kvstore_node(config, name="second")
    client = KvStoreClient(node.address)
    try:
        prefix = await client.get_prefix([b.key for b in chain], MODEL)
        assert [bytes(b.payload) for b in prefix] == [bytes(b.payload) for b in chain[:2]]
    finally:
        await client.close()
