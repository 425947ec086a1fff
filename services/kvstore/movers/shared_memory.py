"""The same-host mover: payloads through shared memory, only headers over gRPC.

*put*: ``ReserveShm`` returns offsets of room in the node's host pool (a memfd this process maps
once); the payloads are copied straight there and ``CommitShm`` turns the room into blocks (the
commit can hold room for the next put of the same shape: one round trip per put). *get*:
``GetShm`` leases the blocks and returns their offsets; they are copied out, checksummed on the
way. A client that cannot map the pool (another host, another PID namespace: the reply's pool
identity tells) goes through a ``/dev/shm`` segment of its own; one whose node cannot open that
either gives this mover up. Blocks the node had no room for go over ``rest`` (gRPC).
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import time
from collections.abc import Sequence

import grpc

from crescent.protos import kvstore_pb2
from crescent.services.kvstore import shm
from crescent.services.kvwire import shm_files
from crescent.services.kvstore.movers.base import Mover, NodeLink, PutResult, refused
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.fused_copy import ParallelCopier, empty_buffer
from crescent.services.kvwire.kv_block import KvBlock

log = logging.getLogger(__name__)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class SharedMemoryMover(Mover):
    name = "shm"

    def __init__(self, link: NodeLink, rest: Mover, copy_threads: int | None = None) -> None:
        """``rest``: where blocks go that the node has no pool room for; ``copy_threads``: threads
        that copy payloads (default: up to 2)."""
        super().__init__(link)
        self._rest = rest
        if not shm_files.available():
            self.give_up("no shared memory on this host")
        self._copier = ParallelCopier(copy_threads) if self.usable else None
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
        # (payload sizes, reservation, when received)
        self._ahead: tuple[tuple[int, ...], kvstore_pb2.ShmReserveReply, float] | None = None

    async def put(self, blocks: Sequence[KvBlock]) -> PutResult | None:
        return await self._put_shm(blocks)

    async def get(self, request: kvstore_pb2.GetRequest, model_id: str | None,
                  corrupt: list[BlockKey]) -> dict[BlockKey, KvBlock] | None:
        return await self._get_shm(request, model_id, corrupt)

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
        self.link.failed(operation, exc)
        if refused(exc):
            self.give_up("the node cannot open this client's shared memory")

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
                reply = await self.link.stub.ReserveShm(
                    kvstore_pb2.ShmReserveRequest(blocks=[b.to_meta() for b in blocks]),
                    timeout=self.link.timeout_s,
                )
            except (grpc.aio.AioRpcError, OSError) as exc:
                if refused(exc):
                    self._reserve_unusable = True  # a node without a shared pool: segments from now on
                    return None
                self.link.failed("put_shm", exc)
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
            self.link.failed("put_shm", exc)
            pool = None  # commit nothing, give the room back, then put another way
        request = kvstore_pb2.ShmCommitRequest(reservation=reply.reservation, written=written)
        if ahead is not None:
            request.blocks.extend(b.to_meta() for b in blocks)
        if pool is not None and all(sizes):
            request.reserve_next.extend(sizes)
        try:
            committed = await self.link.stub.CommitShm(request, timeout=self.link.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self.link.failed("put_shm", exc)
            return PutResult(0, len(blocks), failed=True)
        if committed.HasField("next"):
            self._ahead = (sizes, committed.next, time.monotonic())
        if pool is None and any(slot.granted for slot in reply.slots):
            return None  # this client cannot write the pool: the reservation was given back unused
        rest = await self._rest.put(others)
        return PutResult(committed.stored + rest.stored, committed.rejected + rest.rejected, rest.failed)

    async def _release_ahead(self, reply: kvstore_pb2.ShmReserveReply) -> None:
        """Give back room held for a put that did not come (the node would after a while)."""
        try:
            await self.link.stub.CommitShm(
                kvstore_pb2.ShmCommitRequest(reservation=reply.reservation,
                                             written=[False] * len(reply.slots)),
                timeout=self.link.timeout_s,
            )
        except (grpc.aio.AioRpcError, OSError) as exc:
            log.debug("kvstore %s: giving back reserved room failed (%s); it expires by itself",
                      self.link.address, exc)

    async def _put_segment(self, blocks: Sequence[KvBlock]) -> PutResult | None:
        segment = self._segment(sum(b.nbytes for b in blocks))
        try:
            request = kvstore_pb2.ShmPutRequest(segment=segment.name)
            offset = 0
            for block in blocks:
                segment.buf[offset : offset + block.nbytes] = block.payload
                request.blocks.add(meta=block.to_meta(), offset=offset)
                offset += block.nbytes
            reply = await self.link.stub.PutShm(request, timeout=self.link.timeout_s)
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
            reply = await self.link.stub.GetShm(
                kvstore_pb2.ShmGetRequest(
                    request=request, segment=segment.name, capacity=segment.size,
                    segment_only=self._pool_unusable,
                ),
                timeout=self.link.timeout_s,
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
                if self.link.verified(block, model_id, corrupt):
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
                    log.info("cannot map the host pool of kvstore %s (%s); copying through a segment",
                             self.link.address, exc)
                    self._pool_unusable = True
                    return None
                self._pool_path, self._pool_view, self._pool_map = path, memoryview(mapping), mapping
        if writable and not self._pool_writable:
            self._reserve_unusable = True
            return None
        return self._pool_view

    async def writable_pool(self, path: str, identity: str) -> memoryview | None:
        """The node's pool mapped read-write (for layer-wise puts: ``shm_layers.py``); None when
        this client cannot write it."""
        if self._pool_unusable or self._reserve_unusable:
            return None
        return await self._pool(path, identity, writable=True)

    def _unmap_pool(self) -> None:
        if self._pool_map is not None:
            assert self._pool_view is not None
            try:
                self._pool_view.release()
                self._pool_map.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes when it does
                log.debug("kvstore %s: pool mapping still in use; left to the garbage collector",
                          self.link.address)
        self._pool_view = self._pool_map = None

    async def close(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            await self._release_ahead(ahead[1])
        self._unmap_pool()
        if self._copier is not None:
            self._copier.close()
        for segment in self._free_segments:
            segment.close()
        self._free_segments = []


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
                if shm_files.file_identity(f.fileno()) != identity:
                    raise OSError(f"{path} is not the node's pool here (another host or PID namespace)")
                st = os.fstat(f.fileno())
                resident = st.st_blocks * 512 >= 0.9 * st.st_size
                flags = mmap.MAP_SHARED | (_POPULATE if resident and st.st_size <= POPULATE_POOL_BYTES else 0)
                return mmap.mmap(f.fileno(), 0, flags=flags, prot=prot), "+" in mode
        except (OSError, ValueError) as exc:
            error = exc
    assert error is not None
    raise error
