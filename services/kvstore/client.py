"""Client of a kvstore node, for prefill/decode and for other kvstore nodes.

The store is only a cache: every failure (unreachable node, deadline, bad reply, corrupt block)
is logged, counted in ``errors`` and answered as a miss or a failed put; nothing here raises
into a request. Every block returned has passed ``KvBlock.verify``.

Same host: with ``shared_memory=True`` payloads go through a /dev/shm segment and only headers
go over gRPC; if the server cannot map the segment (another host), the client falls back to
plain gRPC for good.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import mmap
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from crescent.protos import kvstore_pb2, kvstore_pb2_grpc
from crescent.services.common.block_keys import BlockKey
from crescent.services.common.grpc_service import insecure_channel
from crescent.services.common.kv_block import (
    DEFAULT_MAX_CHUNK_BYTES,
    BlockAssembler,
    BlockFormatError,
    BlockIntegrityError,
    KvBlock,
    block_to_chunks,
)
from crescent.services.kvstore import shm

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PutResult:
    stored: int
    rejected: int
    failed: bool = False  # the store could not be reached: nothing was stored


class KvStoreClient:
    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        shared_memory: bool = False,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.max_chunk_bytes = max_chunk_bytes
        self.errors: collections.Counter[str] = collections.Counter()  # by operation and "integrity"
        self._channel = insecure_channel(address)
        self._stub = kvstore_pb2_grpc.KvStoreStub(self._channel)
        self._use_shm = shared_memory and shm.available()
        self._free_segments: list[shm.ShmSegment] = []
        self._pool_path = ""
        self._pool_view: memoryview | None = None
        self._pool_map: mmap.mmap | None = None

    @property
    def uses_shared_memory(self) -> bool:
        return self._use_shm

    def _failed(self, operation: str, exc: BaseException) -> None:
        self.errors[operation] += 1
        if isinstance(exc, grpc.aio.AioRpcError):
            log.warning("kvstore %s %s failed: %s %s", self.address, operation, exc.code().name, exc.details())
        else:
            log.warning("kvstore %s %s failed: %r", self.address, operation, exc)

    def _verified(self, block: KvBlock, model_id: str | None) -> bool:
        try:
            block.verify(model_id)
            return True
        except BlockIntegrityError as exc:
            self.errors["integrity"] += 1
            log.warning("kvstore %s returned a bad block, treated as a miss: %s", self.address, exc)
            return False

    # -- put ------------------------------------------------------------------------------

    async def put(self, blocks: Sequence[KvBlock]) -> PutResult:
        if not blocks:
            return PutResult(0, 0)
        if self._use_shm:
            result = await self._put_shm(blocks)
            if result is not None:
                return result
        try:
            reply = await self._stub.Put(self._chunks(blocks), timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._failed("put", exc)
            return PutResult(0, len(blocks), failed=True)
        return PutResult(reply.stored, reply.rejected)

    async def _chunks(self, blocks: Sequence[KvBlock]) -> AsyncIterator:
        for block in blocks:
            for chunk in block_to_chunks(block, self.max_chunk_bytes):
                yield chunk

    # -- get ------------------------------------------------------------------------------

    async def get_prefix(self, keys: Sequence[BlockKey], model_id: str, lease_ms: int = 0) -> list[KvBlock]:
        """The longest run of blocks from the start of ``keys`` that the store holds, verified."""
        found = await self._get(keys, model_id, lease_ms, stop_at_first_miss=True)
        prefix = []
        for key in keys:
            block = found.get(key)
            if block is None:
                break
            prefix.append(block)
        return prefix

    async def get(
        self, keys: Sequence[BlockKey], model_id: str | None = None, lease_ms: int = 0, *, local_only: bool = False
    ) -> dict[BlockKey, KvBlock]:
        """Whichever of ``keys`` the store holds, verified (``model_id`` None: any model)."""
        return await self._get(keys, model_id, lease_ms, stop_at_first_miss=False, local_only=local_only)

    async def _get(
        self,
        keys: Sequence[BlockKey],
        model_id: str | None,
        lease_ms: int,
        *,
        stop_at_first_miss: bool,
        local_only: bool = False,
    ) -> dict[BlockKey, KvBlock]:
        if not keys:
            return {}
        request = kvstore_pb2.GetRequest(
            keys=keys, model_id=model_id or "", lease_ms=lease_ms,
            stop_at_first_miss=stop_at_first_miss, local_only=local_only,
        )
        if self._use_shm:
            found = await self._get_shm(request, model_id)
            if found is not None:
                return found
        found: dict[BlockKey, KvBlock] = {}
        wanted = set(keys)
        assembler = BlockAssembler(replies=True)
        try:
            async for chunk in self._stub.Get(request, timeout=self.timeout_s):
                block = assembler.feed(chunk)
                if block is not None and block.key in wanted and self._verified(block, model_id):
                    found[block.key] = block
        except (grpc.aio.AioRpcError, OSError, BlockFormatError) as exc:
            self._failed("get", exc)  # keep what was complete: a prefix stays a prefix
        return found

    # -- small calls ----------------------------------------------------------------------

    async def exists(self, keys: Sequence[BlockKey], model_id: str = "") -> list[bool]:
        try:
            reply = await self._stub.Exists(kvstore_pb2.KeysRequest(keys=keys, model_id=model_id), timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._failed("exists", exc)
            return [False] * len(keys)
        return list(reply.present)

    async def remove(self, keys: Sequence[BlockKey]) -> int:
        try:
            reply = await self._stub.Remove(kvstore_pb2.KeysRequest(keys=keys), timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._failed("remove", exc)
            return 0
        return reply.removed

    async def stat(self) -> kvstore_pb2.StatReply | None:
        try:
            return await self._stub.Stat(kvstore_pb2.StatRequest(), timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._failed("stat", exc)
            return None

    async def replicate(self, keys: Sequence[BlockKey], target: str) -> int:
        """Ask this node to copy ``keys`` to ``target`` (a peer's node id or host:port)."""
        try:
            reply = await self._stub.Replicate(kvstore_pb2.ReplicateRequest(keys=keys, target=target), timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._failed("replicate", exc)
            return 0
        return reply.replicated

    async def list_blocks(self, tier: int = 0, limit: int = 0, start_after: bytes = b"") -> kvstore_pb2.ListReply | None:
        try:
            return await self._stub.List(
                kvstore_pb2.ListRequest(tier=tier, limit=limit, start_after=start_after), timeout=self.timeout_s
            )
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._failed("list", exc)
            return None

    # -- shared memory --------------------------------------------------------------------

    def _segment(self, size: int) -> shm.ShmSegment:
        for i, segment in enumerate(self._free_segments):
            if segment.size >= size:
                return self._free_segments.pop(i)
        return shm.ShmSegment.create(max(size, 1 << 20))

    def _release(self, segment: shm.ShmSegment) -> None:
        self._free_segments.append(segment)
        if len(self._free_segments) > 4:  # keep the biggest few warm
            self._free_segments.sort(key=lambda s: s.size)
            self._free_segments.pop(0).close()

    def _shm_unusable(self, operation: str, exc: BaseException) -> None:
        self._failed(operation, exc)
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in (
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED,
        ):
            log.info("kvstore %s cannot use shared memory; using gRPC from now on", self.address)
            self._use_shm = False

    async def _put_shm(self, blocks: Sequence[KvBlock]) -> PutResult | None:
        segment = self._segment(sum(b.nbytes for b in blocks))
        try:
            request = kvstore_pb2.ShmPutRequest(segment=segment.name)
            offset = 0
            for block in blocks:
                segment.buf[offset : offset + block.nbytes] = block.payload
                request.blocks.add(meta=block.to_meta(), offset=offset)
                offset += block.nbytes
            reply = await self._stub.PutShm(request, timeout=self.timeout_s)
            return PutResult(reply.stored, reply.rejected)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._shm_unusable("put_shm", exc)
            return None
        finally:
            self._release(segment)

    async def _get_shm(self, request: kvstore_pb2.GetRequest, model_id: str | None) -> dict[BlockKey, KvBlock] | None:
        segment = self._segment(self._shm_get_size)
        try:
            reply = await self._stub.GetShm(
                kvstore_pb2.ShmGetRequest(
                    request=request, segment=segment.name, capacity=segment.size, segment_only=self._pool_unusable
                ),
                timeout=self.timeout_s,
            )
            pool = self._pool(reply.pool_path) if any(item.in_pool for item in reply.blocks) else None
            if pool is None and any(item.in_pool for item in reply.blocks):
                return await self._get_shm(request, model_id)  # now asking for segment copies only
            found: dict[BlockKey, KvBlock] = {}
            for item in reply.blocks:
                if not item.meta.found:
                    continue
                source = pool if item.in_pool else segment.buf
                assert source is not None
                end = item.offset + item.meta.nbytes
                if end > len(source):
                    raise OSError("block lies past the end of the shared memory")
                # Copy out: the segment is reused by the next call, pool pages by the node.
                block = KvBlock.from_meta(item.meta, bytes(source[item.offset : end]))
                if self._verified(block, model_id):
                    found[block.key] = block
            if reply.truncated:
                self._shm_get_size = min(segment.size * 2, 1 << 31)
                rest = [k for k in request.keys if k not in found]
                missed = any(not item.meta.found for item in reply.blocks)
                if rest and not (request.stop_at_first_miss and missed):
                    more = kvstore_pb2.GetRequest()
                    more.CopyFrom(request)
                    del more.keys[:]
                    more.keys.extend(rest)
                    again = await self._get_shm(more, model_id)
                    found.update(again or {})
            return found
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._shm_unusable("get_shm", exc)
            return None
        finally:
            self._release(segment)

    _shm_get_size = 64 << 20
    _pool_unusable = False

    def _pool(self, path: str) -> memoryview | None:
        """The node's host pool, mapped read-only once; None (for good) if this client cannot."""
        if self._pool_view is not None and self._pool_path == path:
            return self._pool_view
        try:
            with open(path, "rb") as f:
                mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            log.info("cannot map the host pool of kvstore %s (%s); copying through a segment", self.address, exc)
            self._pool_unusable = True
            return None
        self._pool_path, self._pool_view, self._pool_map = path, memoryview(mapping), mapping
        return self._pool_view

    async def close(self) -> None:
        await self._channel.close()
        if self._pool_map is not None:
            assert self._pool_view is not None
            self._pool_view.release()
            self._pool_map.close()
            self._pool_view = self._pool_map = None
        for segment in self._free_segments:
            segment.close()
        self._free_segments = []


async def wait_ready(client: KvStoreClient, timeout_s: float = 10.0) -> bool:
    """Poll ``stat`` until the node answers (tests and start-up ordering)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            await client._stub.Stat(kvstore_pb2.StatRequest(), timeout=1.0)
            return True
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.05)
    return False
