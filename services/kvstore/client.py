"""Client of a kvstore node, for prefill/decode and for other kvstore nodes.

The store is only a cache: every failure (unreachable node, deadline, bad reply, corrupt block)
is logged, counted in ``errors`` and answered as a miss or a failed put; nothing here raises
into a request. Every block returned has passed ``KvBlock.verify``.

Same host: with ``shared_memory=True`` only headers go over gRPC. Puts copy payloads straight
into room reserved in the node's host pool and gets copy straight out of it, checking each
block's CRC as it is copied; a client that cannot map the pool goes through a /dev/shm segment
of its own, and one whose node cannot map that either (another host) uses plain gRPC for good.

Put and Get payloads travel through ``chunk_wire`` (protobuf's own bytes, without its copies).

A block that fails its check is reported back (``Remove`` with ``crescent-reason: corrupt``):
the node does not re-check host memory on reads, so readers' checks are how it learns that a
copy went bad; it re-checks that copy and drops and counts it if it is bad.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import mmap
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from crescent.protos import kvstore_pb2, kvstore_pb2_grpc
from crescent.services.kvwire import chunk_wire
from crescent.services.kvwire.block_keys import BlockKey
from crescent.services.common.grpc_service import open_channel
from crescent.services.common.tls import PeerTls
from crescent.services.kvwire.kv_block import (
    DEFAULT_MAX_CHUNK_BYTES,
    BlockAssembler,
    BlockFormatError,
    BlockIntegrityError,
    KvBlock,
)
from crescent.services.kvwire.fused_copy import ParallelCopier, empty_buffer
from crescent.services.kvstore import shm

log = logging.getLogger(__name__)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
# Metadata of a Remove call that reports blocks a reader found corrupt (no proto change needed).
REASON_METADATA = "crescent-reason"
REASON_CORRUPT = "corrupt"


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
        copy_threads: int | None = None,
        tls: PeerTls | None = None,
    ) -> None:
        """``copy_threads``: threads that copy shared-memory payloads (default: up to 2); ``tls``:
        this process's key pair (None: plaintext)."""
        self.address = address
        self.timeout_s = timeout_s
        self.max_chunk_bytes = max_chunk_bytes
        self.errors: collections.Counter[str] = collections.Counter()  # by operation and "integrity"
        self._channel = open_channel(address, tls)
        self._stub = kvstore_pb2_grpc.KvStoreStub(self._channel)
        self._put_stream = self._channel.stream_unary(
            "/crescent.v1.KvStore/Put", request_serializer=chunk_wire.encode_chunk,
            response_deserializer=kvstore_pb2.PutReply.FromString,
        )
        self._get_stream = self._channel.unary_stream(
            "/crescent.v1.KvStore/Get", request_serializer=kvstore_pb2.GetRequest.SerializeToString,
            response_deserializer=chunk_wire.decode_chunk,
        )
        self._use_shm = shared_memory and shm.available()
        self._copier = ParallelCopier(copy_threads) if self._use_shm else None
        self._free_segments: list[shm.ShmSegment] = []
        self._pool_path = ""
        self._pool_view: memoryview | None = None
        self._pool_map: mmap.mmap | None = None
        self._pool_writable = False
        self._pool_lock = asyncio.Lock()
        self._pool_unusable = False
        self._reserve_unusable = False
        # Pool room the node holds for our next put (payload sizes, reservation): a put of the
        # same shape then costs one round trip. Blocks of one model are all one size.
        self._ahead: tuple[tuple[int, ...], kvstore_pb2.ShmReserveReply, float] | None = None  # + when received

    @property
    def uses_shared_memory(self) -> bool:
        return self._use_shm

    def _failed(self, operation: str, exc: BaseException) -> None:
        self.errors[operation] += 1
        if isinstance(exc, grpc.aio.AioRpcError):
            log.warning("kvstore %s %s failed: %s %s", self.address, operation, exc.code().name, exc.details())
        else:
            log.warning("kvstore %s %s failed: %s", self.address, operation, repr(exc))

    def _verified(self, block: KvBlock, model_id: str | None, corrupt: list[BlockKey]) -> bool:
        """Whether ``block`` is safe to use; a damaged one (not merely another model's) is
        added to ``corrupt``, to be reported to the node."""
        try:
            block.verify(model_id)
            return True
        except BlockIntegrityError as exc:
            self.errors["integrity"] += 1
            # str(exc), not exc: a kept log record would hold the traceback's frames, and with
            # them views of the shared pool that must not outlive this call.
            log.warning("kvstore %s returned a bad block, treated as a miss: %s", self.address, str(exc))
            if model_id is None or block.model_id == model_id:
                corrupt.append(block.key)
            return False

    async def _report_corrupt(self, keys: list[BlockKey]) -> None:
        """Tell the node which blocks failed our check, so it drops its bad copies."""
        if not keys:
            return
        try:
            reply = await self._stub.Remove(
                kvstore_pb2.KeysRequest(keys=keys), timeout=self.timeout_s,
                metadata=((REASON_METADATA, REASON_CORRUPT),),
            )
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._failed("report_corrupt", exc)
            return
        log.info("kvstore %s dropped %d of %d blocks reported corrupt", self.address, reply.removed, len(keys))

    # -- put ------------------------------------------------------------------------------

    async def put(self, blocks: Sequence[KvBlock]) -> PutResult:
        if not blocks:
            return PutResult(0, 0)
        if self._use_shm:
            result = await self._put_shm(blocks)
            if result is not None:
                return result
        return await self._put_grpc(blocks)

    async def _put_grpc(self, blocks: Sequence[KvBlock]) -> PutResult:
        if not blocks:
            return PutResult(0, 0)
        try:
            reply = await self._put_stream(self._chunks(blocks), timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._failed("put", exc)
            return PutResult(0, len(blocks), failed=True)
        return PutResult(reply.stored, reply.rejected)

    async def _chunks(self, blocks: Sequence[KvBlock]) -> AsyncIterator[chunk_wire.WireChunk]:
        for block in blocks:
            for chunk in chunk_wire.block_chunks(block.to_meta(), block.payload, self.max_chunk_bytes):
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
        corrupt: list[BlockKey] = []
        found = await self._get_shm(request, model_id, corrupt) if self._use_shm else None
        if found is None:
            found = await self._get_grpc(request, model_id, corrupt)
        await self._report_corrupt(corrupt)
        return found

    async def _get_grpc(
        self, request: kvstore_pb2.GetRequest, model_id: str | None, corrupt: list[BlockKey]
    ) -> dict[BlockKey, KvBlock]:
        found: dict[BlockKey, KvBlock] = {}
        wanted = set(request.keys)
        assembler = BlockAssembler(replies=True)
        try:
            async for chunk in self._get_stream(request, timeout=self.timeout_s):
                if chunk.error:
                    raise BlockFormatError(chunk.error)
                block = assembler.feed(chunk)
                if block is not None and block.key in wanted and self._verified(block, model_id, corrupt):
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
        if _refused(exc):
            log.info("kvstore %s cannot use shared memory; using gRPC from now on", self.address)
            self._use_shm = False

    async def _put_shm(self, blocks: Sequence[KvBlock]) -> PutResult | None:
        if not (self._reserve_unusable or self._pool_unusable):
            result = await self._put_in_pool(blocks)
            if result is not None:
                return result
        return await self._put_segment(blocks)

    async def _put_in_pool(self, blocks: Sequence[KvBlock]) -> PutResult | None:
        """Copy each payload into room in the node's pool, then commit. The room is reserved
        ahead by the previous put of the same shape, or now; blocks the node had no room for go
        over gRPC."""
        sizes = tuple(b.nbytes for b in blocks)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (ahead[0] != sizes or not _fresh(ahead[1], ahead[2])):
            await self._release_ahead(ahead[1])
            ahead = None
        if ahead is not None:
            reply = ahead[1]
        else:
            reserved_at = time.monotonic()
            try:
                reply = await self._stub.ReserveShm(
                    kvstore_pb2.ShmReserveRequest(blocks=[b.to_meta() for b in blocks]), timeout=self.timeout_s
                )
            except (grpc.aio.AioRpcError, OSError) as exc:
                if _refused(exc):
                    self._reserve_unusable = True  # a node without a shared pool: segments from now on
                    return None
                self._failed("put_shm", exc)
                return PutResult(0, len(blocks), failed=True)
        pool = await self._pool(reply.pool_path, reply.pool_identity, writable=True)
        if ahead is None and not _fresh(reply, reserved_at):
            pool = None  # this thread was held up for long: the room may be someone else's by now
        assert self._copier is not None
        pairs, copied, others = [], [], []
        for i, (block, slot) in enumerate(zip(blocks, reply.slots)):
            if slot.granted and pool is not None and slot.offset + block.nbytes <= len(pool):
                pairs.append((pool[slot.offset : slot.offset + block.nbytes], block.payload))
                copied.append(i)
            elif not slot.granted and not slot.held:
                others.append(block)
        written = [False] * len(reply.slots)
        try:
            # A plain copy: the payload is the one its checksum was computed from, and every
            # reader verifies it; a CRC here would cost a third of the copy again.
            self._copier.copy(pairs, checksum=False)
            for i in copied:
                written[i] = True
        except (ValueError, BufferError, RuntimeError) as exc:  # e.g. the mapping went away
            self._failed("put_shm", exc)
            pool = None  # commit nothing, give the room back, then put another way
        request = kvstore_pb2.ShmCommitRequest(reservation=reply.reservation, written=written)
        if ahead is not None:
            request.blocks.extend(b.to_meta() for b in blocks)
        if pool is not None and all(sizes):
            request.reserve_next.extend(sizes)
        try:
            committed = await self._stub.CommitShm(request, timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._failed("put_shm", exc)
            return PutResult(0, len(blocks), failed=True)
        if committed.HasField("next"):
            self._ahead = (sizes, committed.next, time.monotonic())
        if pool is None and any(slot.granted for slot in reply.slots):
            return None  # this client cannot write the pool: the reservation was given back unused
        rest = await self._put_grpc(others)
        return PutResult(committed.stored + rest.stored, committed.rejected + rest.rejected, rest.failed)

    async def _release_ahead(self, reply: kvstore_pb2.ShmReserveReply) -> None:
        """Give back room held for a put that did not come (the node would after a while)."""
        try:
            await self._stub.CommitShm(
                kvstore_pb2.ShmCommitRequest(reservation=reply.reservation, written=[False] * len(reply.slots)),
                timeout=self.timeout_s,
            )
        except (grpc.aio.AioRpcError, OSError) as exc:
            log.debug("kvstore %s: giving back reserved room failed (%s); it expires by itself", self.address, exc)

    async def _put_segment(self, blocks: Sequence[KvBlock]) -> PutResult | None:
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

    async def _get_shm(
        self, request: kvstore_pb2.GetRequest, model_id: str | None, corrupt: list[BlockKey]
    ) -> dict[BlockKey, KvBlock] | None:
        segment = self._segment(self._shm_get_size)
        try:
            reply = await self._stub.GetShm(
                kvstore_pb2.ShmGetRequest(
                    request=request, segment=segment.name, capacity=segment.size, segment_only=self._pool_unusable
                ),
                timeout=self.timeout_s,
            )
            in_pool = any(item.in_pool for item in reply.blocks)
            pool = await self._pool(reply.pool_path, reply.pool_identity) if in_pool else None
            if pool is None and in_pool:
                return await self._get_shm(request, model_id, corrupt)  # now asking for segment copies only
            found: dict[BlockKey, KvBlock] = {}
            items, pairs = [], []
            for item in reply.blocks:
                if not item.meta.found:
                    continue
                source = pool if item.in_pool else segment.buf
                assert source is not None
                end = item.offset + item.meta.nbytes
                if end > len(source):
                    raise OSError("block lies past the end of the shared memory")
                items.append(item)
                pairs.append((empty_buffer(item.meta.nbytes), source[item.offset : end]))
            # Copy out (the segment is reused by the next call, pool pages by the node),
            # checksumming on the way: a block changed under us is caught here.
            assert self._copier is not None
            for item, (payload, _), crc in zip(items, pairs, self._copier.copy(pairs)):
                block = KvBlock.from_meta(item.meta, payload.toreadonly(), payload_crc=crc)
                if self._verified(block, model_id, corrupt):
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
                    again = await self._get_shm(more, model_id, corrupt)
                    found.update(again or {})
            return found
        except (grpc.aio.AioRpcError, OSError, ValueError, BufferError, RuntimeError) as exc:
            self._shm_unusable("get_shm", exc)  # this call goes over gRPC instead
            return None
        finally:
            self._release(segment)

    _shm_get_size = 64 << 20

    async def _pool(self, path: str, identity: str, *, writable: bool = False) -> memoryview | None:
        """The node's host pool, mapped once (read-write if allowed, for in-place puts); None if
        this client cannot map it (for good), or cannot write it and ``writable`` is asked."""
        async with self._pool_lock:  # concurrent first calls map it once
            if self._pool_unusable:
                return None
            if self._pool_view is None or self._pool_path != path:
                # A new path: the node restarted. The old mapping is only dropped, never released
                # here: another call may still be copying from it; it goes when they are done.
                self._pool_view = self._pool_map = None
                try:
                    mapping, self._pool_writable = await asyncio.to_thread(_map_pool, path, identity)
                except (OSError, ValueError) as exc:
                    log.info("cannot map the host pool of kvstore %s (%s); copying through a segment", self.address, exc)
                    self._pool_unusable = True
                    return None
                self._pool_path, self._pool_view, self._pool_map = path, memoryview(mapping), mapping
        if writable and not self._pool_writable:
            self._reserve_unusable = True
            return None
        return self._pool_view

    def _unmap_pool(self) -> None:
        if self._pool_map is not None:
            assert self._pool_view is not None
            try:
                self._pool_view.release()
                self._pool_map.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes when it does
                log.debug("kvstore %s: pool mapping still in use; left to the garbage collector", self.address)
        self._pool_view = self._pool_map = None

    async def close(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            await self._release_ahead(ahead[1])
        await self._channel.close()
        self._unmap_pool()
        if self._copier is not None:
            self._copier.close()
        for segment in self._free_segments:
            segment.close()
        self._free_segments = []


def _refused(exc: BaseException) -> bool:
    """The node cannot do this for us at all (another host, a feature off or missing), as
    opposed to a call that failed this time."""
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in (
        grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED,
    )


def _fresh(reply: kvstore_pb2.ShmReserveReply, received: float) -> bool:
    """Whether reserved room is still safely ours: the node gives it back after ``expires_ms``,
    so a copy starts only in the first half of that (a copy takes milliseconds)."""
    return time.monotonic() < received + reply.expires_ms / 2000


# Map pools up to this size with MAP_POPULATE: a page's first touch through a new mapping
# faults (measured 2.5 GB/s for fresh pages against 12 for mapped ones), and populating at map
# time costs ~90 ms per GiB once. Only a pool whose pages all exist already (the node was told
# to prefault it) is populated: populating would otherwise allocate the node's whole pool.
POPULATE_POOL_BYTES = 16 << 30


def _map_pool(path: str, identity: str) -> tuple[mmap.mmap, bool]:
    """(mapping, writable): read-write when this process may write the file, else read-only.
    Raises OSError when ``path`` here is not the node's pool (``identity`` differs)."""
    error: OSError | ValueError | None = None
    for mode, prot in (("r+b", mmap.PROT_READ | mmap.PROT_WRITE), ("rb", mmap.PROT_READ)):
        try:
            with open(path, mode) as f:
                if shm.file_identity(f.fileno()) != identity:
                    raise OSError(f"{path} is not the node's pool here (another host or PID namespace)")
                st = os.fstat(f.fileno())
                resident = st.st_blocks * 512 >= 0.9 * st.st_size
                flags = mmap.MAP_SHARED | (_POPULATE if resident and st.st_size <= POPULATE_POOL_BYTES else 0)
                return mmap.mmap(f.fileno(), 0, flags=flags, prot=prot), "+" in mode
        except (OSError, ValueError) as exc:
            error = exc
    assert error is not None
    raise error


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
