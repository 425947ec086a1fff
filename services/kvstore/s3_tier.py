"""The S3 tier: one object per block under ``prefix``, any S3-compatible server (aioboto3).

S3 is slow and may be away. Reads that fail are misses; writes go through a bounded queue
worked by a few uploaders, and a write that finds the queue full, or fails, is dropped with a
metric: the cache is only a cache. The index is rebuilt by listing the prefix at start (retried
in the background while S3 is unreachable), so a restarted node finds its objects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aioboto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from crescent.protos import common_pb2
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.common.metrics import KvStoreMetrics
from crescent.services.common.tasks import cancel_and_wait
from crescent.services.kvstore import block_file
from crescent.services.kvstore.config import S3TierSettings
from crescent.services.kvstore.tier import BlockInfo, StorageTier

log = logging.getLogger(__name__)

S3_ERRORS = (BotoCoreError, ClientError, OSError, asyncio.TimeoutError)


class S3Tier(StorageTier):
    kind = common_pb2.KV_TIER_S3

    def __init__(self, settings: S3TierSettings, metrics: KvStoreMetrics) -> None:
        super().__init__(settings)
        self.settings = settings
        self._metrics = metrics
        self._stack = contextlib.AsyncExitStack()
        self._client: Any = None
        self._queue: asyncio.Queue[BlockKey] = asyncio.Queue(maxsize=settings.write_queue_blocks)
        self._pending: dict[BlockKey, bytes] = {}  # encoded, queued or uploading; readable meanwhile
        self._tasks: list[asyncio.Task[None]] = []
        self.indexed = asyncio.Event()

    def object_key(self, key: BlockKey) -> str:
        return f"{self.settings.prefix}{key.hex()}"

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._index or key in self._pending

    async def start(self) -> None:
        s = self.settings
        session = aioboto3.Session(
            aws_access_key_id=s.access_key_id, aws_secret_access_key=s.secret_access_key, region_name=s.region
        )
        config = Config(connect_timeout=s.timeout_s, read_timeout=s.timeout_s, retries={"max_attempts": 1})
        self._client = await self._stack.enter_async_context(
            session.client("s3", endpoint_url=s.endpoint_url, config=config)
        )
        self._tasks = [asyncio.create_task(self._upload_loop(), name=f"s3-upload-{i}") for i in range(s.write_concurrency)]
        self._tasks.append(asyncio.create_task(self._index_until_done(), name="s3-reindex"))

    async def close(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks = []
        await self._stack.aclose()

    async def _index_until_done(self) -> None:
        while True:
            try:
                await self._reindex()
                self.indexed.set()
                return
            except S3_ERRORS as exc:
                self._metrics.s3_errors.labels("list").inc()
                log.warning("S3 tier: cannot list s3://%s/%s (retrying): %s", self.settings.bucket, self.settings.prefix, exc)
                await asyncio.sleep(self.settings.timeout_s)

    async def _reindex(self) -> None:
        s = self.settings
        if s.create_bucket:
            with contextlib.suppress(ClientError):  # already there
                args: dict[str, Any] = {"Bucket": s.bucket}
                if s.region and s.region != "us-east-1":
                    args["CreateBucketConfiguration"] = {"LocationConstraint": s.region}
                await self._client.create_bucket(**args)
        found = 0
        paginator = self._client.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=s.bucket, Prefix=s.prefix):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(s.prefix) :]
                try:
                    key = BlockKey(bytes.fromhex(name))
                except ValueError:
                    continue  # not one of ours
                if key not in self._index:
                    # Only the size is known without reading; the rest fills in on first read.
                    self._indexed(key, BlockInfo(int(obj["Size"])))
                    found += 1
        log.info("S3 tier: %d blocks found under s3://%s/%s", found, s.bucket, s.prefix)

    async def write(self, block: KvBlock) -> bool:
        if block.key in self._pending:
            return True
        try:
            self._queue.put_nowait(block.key)
        except asyncio.QueueFull:
            self._metrics.dropped_writes.labels(self.label).inc()
            log.warning("S3 tier: write queue full, dropping block %s", block.key.hex())
            return False
        # Encode now: the payload may be a view of host memory that is reused after this call.
        self._pending[block.key] = block_file.encode(block)
        self._indexed(block.key, BlockInfo.of(block))
        return True

    async def _upload_loop(self) -> None:
        await self.indexed.wait()  # the bucket may be created by the indexing task
        while True:
            key = await self._queue.get()
            body = self._pending.get(key)
            if body is None:
                continue  # deleted while queued
            try:
                await asyncio.wait_for(
                    self._client.put_object(Bucket=self.settings.bucket, Key=self.object_key(key), Body=body),
                    self.settings.timeout_s * 2,
                )
            except S3_ERRORS as exc:
                self._metrics.s3_errors.labels("put").inc()
                self._metrics.dropped_writes.labels(self.label).inc()
                log.warning("S3 tier: upload of %s failed, dropped: %s", key.hex(), exc)
                if self._pending.get(key) is body:
                    self._unindexed(key)
            finally:
                if self._pending.get(key) is body:
                    del self._pending[key]

    async def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until queued uploads are done (tests and clean shutdown)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._pending and loop.time() < deadline:
            await asyncio.sleep(0.01)

    async def read(self, key: BlockKey) -> KvBlock | None:
        pending = self._pending.get(key)
        if pending is not None:
            return block_file.decode(pending)
        if key not in self._index:
            return None
        try:
            reply = await asyncio.wait_for(
                self._client.get_object(Bucket=self.settings.bucket, Key=self.object_key(key)), self.settings.timeout_s
            )
            async with reply["Body"] as body:
                data = await asyncio.wait_for(body.read(), self.settings.timeout_s * 4)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                self._unindexed(key)  # gone behind our back (lifecycle rule, another node)
                return None
            self._metrics.s3_errors.labels("get").inc()
            log.warning("S3 tier: get %s failed: %s", key.hex(), exc)
            return None
        except S3_ERRORS as exc:
            self._metrics.s3_errors.labels("get").inc()
            log.warning("S3 tier: get %s failed: %s", key.hex(), exc)
            return None
        block = block_file.decode(data)
        if self._index.get(key, BlockInfo(0)).model_id == "":
            self._indexed(key, BlockInfo(len(data), block.parent_key, block.model_id, block.num_tokens))
        return block

    async def delete(self, key: BlockKey) -> bool:
        self._pending.pop(key, None)
        held = self._unindexed(key)
        if held:
            try:
                await asyncio.wait_for(
                    self._client.delete_object(Bucket=self.settings.bucket, Key=self.object_key(key)),
                    self.settings.timeout_s,
                )
            except S3_ERRORS as exc:
                self._metrics.s3_errors.labels("delete").inc()
                log.warning("S3 tier: delete %s failed: %s", key.hex(), exc)
        return held
