"""The KvStore gRPC servicer: a thin shell over ``TieredStore`` plus peers and the byte movers'
control calls (reserve/commit, shared-memory and side-channel gets)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from crescent.protos import common_pb2, kvstore_pb2, kvstore_pb2_grpc
from crescent.services.kvwire import chunk_wire
from crescent.services.kvwire.grpc_codecs import add_with_codecs
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import BlockAssembler, BlockFormatError, KvBlock, expected_nbytes, meta_of
from crescent.services.common.tasks import cancel_and_wait
from crescent.services.common.tls import PeerTls
from crescent.services.kvstore.client import REASON_CORRUPT, REASON_METADATA
from crescent.services.kvstore.config import KvStoreSettings
from crescent.services.kvstore.mover_endpoints import MoverEndpoints
from crescent.services.kvstore.peers import PeerSet
from crescent.services.kvstore.reservations import Landing, PendingReservations, Slot
from crescent.services.kvstore.shm import AttachedSegments, ShmError, ShmSegment
from crescent.services.kvstore.store import TieredStore
from crescent.services.kvstore.tier import HostTier, SpaceReservation

log = logging.getLogger(__name__)

DEFAULT_LIST_LIMIT = 1000
# What ReserveShm's mover may name ("" and "shm": shared memory; "shm-layers": shared memory
# written a layer at a time while prefill computes, its headers and CRCs sent at commit).
LAYERS_MOVER = "shm-layers"  # its room lives layer_reservation_ms, not shm_reservation_ms
MOVERS = ("", "shm", LAYERS_MOVER, "tcp", "nixl")
SHARED_MEMORY_MOVERS = ("", "shm", LAYERS_MOVER)
CHECKED_AT_COMMIT = ("nixl", LAYERS_MOVER)  # room nobody saw filled whole: its CRC is computed at commit


def add_to_server(servicer: KvStoreServicer, server: grpc.aio.Server) -> None:
    """The generated registration, with Put's requests and Get's replies through ``chunk_wire``
    (the same bytes on the wire, without protobuf's payload copies)."""
    add_with_codecs(kvstore_pb2_grpc.add_KvStoreServicer_to_server, servicer, server,
                    requests={"Put": chunk_wire.decode_chunk}, replies={"Get": chunk_wire.encode_chunk})


class KvStoreServicer(kvstore_pb2_grpc.KvStoreServicer):
    def __init__(self, store: TieredStore, settings: KvStoreSettings, tls: PeerTls | None = None) -> None:
        self.store = store
        self.settings = settings
        self.peers = PeerSet(settings.peers, settings.peer_timeout_s, tls)
        self.segments = AttachedSegments()
        front = store.tiers[0]
        self.endpoints = MoverEndpoints(settings, front if isinstance(front, HostTier) else None, tls,
                                        store.metrics.side_channel_refused.inc)
        self.reservations = PendingReservations(store, settings.shm_reservation_ms, self.endpoints.side)
        self._bytes_in = store.metrics.transferred_bytes.labels("in")
        self._bytes_out = store.metrics.transferred_bytes.labels("out")
        self._sweeper = asyncio.get_running_loop().create_task(self._expire_reservations(), name="shm-reservations")

    async def _expire_reservations(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.reservations.lifetime_s))
            if expired := self.reservations.expire():
                log.warning("gave back %d reserved pool blocks a client never committed", expired)

    async def close(self) -> None:
        await cancel_and_wait(self._sweeper)
        await self.endpoints.close()
        self.reservations.expire(everything=True)
        await self.peers.close()
        self.segments.close()

    # -- reads ----------------------------------------------------------------------------

    def _lease_ms(self, requested: int) -> int:
        return min(requested or self.settings.default_lease_ms, self.settings.max_lease_ms)

    async def _lookup(self, request: kvstore_pb2.GetRequest) -> AsyncIterator[tuple[BlockKey, KvBlock | None]]:
        """(key, block or None) in key order; stops after the first miss for prefix reads."""
        keys = [BlockKey(bytes(k)) for k in request.keys]
        lease_ms = self._lease_ms(request.lease_ms)
        from_peers: dict[BlockKey, KvBlock] = {}
        # Pin the blocks still to be read: promoting an early block of a prefix must not push a
        # later one down a tier (or out) just before it is read. Each is unpinned once read.
        unread = list(keys)
        for key in unread:
            self.store.pin(key)
        try:
            async for key, block in self._lookup_pinned(request, keys, lease_ms, from_peers):
                self.store.unpin(key)
                unread.remove(key)
                yield key, block
        finally:
            for key in unread:
                self.store.unpin(key)

    async def _lookup_pinned(self, request: kvstore_pb2.GetRequest, keys: list[BlockKey], lease_ms: int,
                             from_peers: dict[BlockKey, KvBlock]) -> AsyncIterator[tuple[BlockKey, KvBlock | None]]:
        for i, key in enumerate(keys):
            block = await self.store.get(key, request.model_id or None, lease_ms)
            if block is None and key not in from_peers and self.peers.addresses and not request.local_only:
                # A prefix read wants the rest too: fetch it in one round trip per peer.
                wanted = keys[i:] if request.stop_at_first_miss else [key]
                from_peers.update(await self.peers.fetch(wanted, request.model_id))
            if block is None and key in from_peers:
                block = from_peers.pop(key)
                await self.store.put(block)  # hot prefixes replicate themselves
                self.store.leases.grant(key, lease_ms)
            yield key, block
            if block is None and request.stop_at_first_miss:
                return

    async def Get(self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext) -> AsyncIterator:
        max_chunk = self.settings.max_chunk_bytes
        async for key, block in self._lookup(request):
            if block is None:
                yield chunk_wire.miss(key)
                continue
            self._bytes_out.inc(block.nbytes)
            self.store.pin(key)  # the payload may be a view of host memory: keep it until sent
            try:
                for chunk in chunk_wire.block_chunks(meta_of(block), block.payload, max_chunk):
                    yield chunk
            finally:
                self.store.unpin(key)

    async def _client_segment(self, name: str, context: grpc.aio.ServicerContext) -> ShmSegment:
        """A same-host client's segment, or the call ends with FAILED_PRECONDITION (the client
        then uses gRPC)."""
        if not self.settings.shared_memory:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "shared memory is disabled on this node")
        try:
            return self.segments.get(name)
        except ShmError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise  # abort raises; this keeps type checkers informed

    def _shared_pool(self) -> HostTier | None:
        """The host tier same-host clients map: only ever the first tier (with a GPU tier in
        front, host memory is page-locked for it and not shared)."""
        tier = self.store.tiers[0]
        shared = self.settings.shared_memory and isinstance(tier, HostTier) and tier.pool.share_path
        return tier if shared else None

    def _reserve_reply(self, host: HostTier, rooms: list[SpaceReservation | None],
                       held: list[bool] | None = None) -> kvstore_pb2.ShmReserveReply:
        """Where ``rooms`` lie in ``host``'s pool (None: no room granted, or ``held`` already)."""
        reply = kvstore_pb2.ShmReserveReply(
            pool_path=host.pool.share_path, pool_identity=host.pool.share_identity,
            expires_ms=self.settings.shm_reservation_ms,
        )
        for i, room in enumerate(rooms):
            if held is not None and held[i]:
                reply.slots.add(held=True)
            else:
                reply.slots.add(granted=room is not None, offset=host.pool.offset_of(room.start) if room else 0)
        return reply

    async def GetShm(self, request: kvstore_pb2.ShmGetRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.ShmGetReply:
        if request.mover == "tcp":
            return await self._get_over_side_channel(request.request, context)
        if request.mover not in MOVERS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown mover {request.mover!r}; gets: shm (empty), tcp")
        segment = await self._client_segment(request.segment, context)
        capacity = min(request.capacity or segment.size, segment.size)
        host = None if request.segment_only else self._shared_pool()
        reply = kvstore_pb2.ShmGetReply()
        if host is not None:
            reply.pool_path, reply.pool_identity = host.pool.share_path, host.pool.share_identity
            if self._reply_from_pool(host, request.request, reply):
                return reply
        offset = 0
        async for key, block in self._lookup(request.request):
            if block is None:
                reply.blocks.add(meta=common_pb2.BlockMeta(key=key, found=False))
                continue
            in_pool = host.pool_offset(key) if host is not None else None
            if in_pool is not None:
                # The client copies straight from our pool; the lease keeps the bytes in place.
                self.store.leases.grant(key, self.settings.transfer_lease_ms)
                reply.blocks.add(meta=meta_of(block), offset=in_pool, in_pool=True)
                self._bytes_out.inc(block.nbytes)
                continue
            if offset + block.nbytes > capacity:
                reply.truncated = True
                break
            segment.buf[offset : offset + block.nbytes] = block.payload
            reply.blocks.add(meta=meta_of(block), offset=offset)
            offset += block.nbytes
            self._bytes_out.inc(block.nbytes)
        return reply

    async def _get_over_side_channel(self, request: kvstore_pb2.GetRequest,
                                     context: grpc.aio.ServicerContext) -> kvstore_pb2.ShmGetReply:
        """Headers now; payloads over the side channel to whoever opens it with the token. The
        blocks stay pinned (their payloads may be views of host memory) until they are sent or
        nobody came for them."""
        side = self.endpoints.side
        if side is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node serves no TCP side channel")
        reply = kvstore_pb2.ShmGetReply(side_address=self.endpoints.side_address)
        keys, payloads = [], []
        try:
            async for key, block in self._lookup(request):
                if block is None:
                    reply.blocks.add(meta=common_pb2.BlockMeta(key=key, found=False))
                    continue
                self.store.pin(key)
                keys.append(key)
                payloads.append(memoryview(block.payload))
                reply.blocks.add(meta=meta_of(block))
                self._bytes_out.inc(block.nbytes)
        except BaseException:
            for key in keys:
                self.store.unpin(key)
            raise
        if keys:  # nothing found: nothing to send, no token
            reply.side_token = self.endpoints.send_then_unpin(self.store, keys, payloads, self.reservations.lifetime_s)
        return reply

    def _reply_from_pool(self, host: HostTier, request: kvstore_pb2.GetRequest, reply: kvstore_pb2.ShmGetReply) -> bool:
        """The common same-host read, every block in this node's pool: offsets and headers with
        no tier walk. False (nothing done) when any block is elsewhere, missing, or another
        model's: the general path handles those."""
        keys = [BlockKey(bytes(k)) for k in request.keys]
        metas = [host.meta(key) for key in keys]
        if any(m is None or (request.model_id and m.model_id != request.model_id) for m in metas):
            return False
        index = self.store.tiers.index(host)
        lease_ms = max(self._lease_ms(request.lease_ms), self.settings.transfer_lease_ms)  # the copy's, at least
        for key, meta in zip(keys, metas):
            self.store.note_hit(index, key, lease_ms)
            reply.blocks.add(meta=meta, offset=host.pool_offset(key), in_pool=True)
            self._bytes_out.inc(meta.nbytes)
        return True

    # -- writes ---------------------------------------------------------------------------

    async def Put(self, request_iterator: AsyncIterator, context: grpc.aio.ServicerContext) -> kvstore_pb2.PutReply:
        """Each block is assembled straight into reserved host-pool room when there is some (one
        copy, checksummed on the way), else into a buffer and placed by the store."""
        assembler = BlockAssembler(max_block_bytes=self.settings.max_block_bytes)
        stored = rejected = 0
        reservation: SpaceReservation | None = None
        try:
            async for chunk in request_iterator:
                if chunk.error:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, chunk.error)
                meta = chunk.meta
                if meta is not None and not assembler.in_progress and 0 < meta.nbytes <= self.settings.max_block_bytes:
                    reservation = await self.store.reserve(meta.nbytes)
                block = assembler.feed(chunk, into=reservation.view if reservation is not None and meta is not None else None)
                if block is None:
                    continue
                self._bytes_in.inc(block.nbytes)
                if reservation is not None:
                    ok = await self.store.commit(block, reservation)
                    reservation = None
                else:
                    ok = await self.store.put(block)
                stored, rejected = stored + ok, rejected + (not ok)
        except BlockFormatError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed block stream: {exc}")
        finally:
            if reservation is not None:  # the stream broke off inside a block
                self.store.release(reservation)
        if assembler.in_progress:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the stream ended inside a block")
        return kvstore_pb2.PutReply(stored=stored, rejected=rejected)

    async def PutShm(self, request: kvstore_pb2.ShmPutRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.PutReply:
        segment = await self._client_segment(request.segment, context)
        stored = rejected = 0
        for item in request.blocks:
            end = item.offset + item.meta.nbytes
            if end > segment.size or item.meta.nbytes > self.settings.max_block_bytes:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"block at {item.offset} runs past the segment")
            # A view, not a copy: the client waits for our answer before reusing its segment,
            # and every tier has copied or encoded the payload by the time put returns.
            block = KvBlock.from_meta(item.meta, segment.buf[item.offset : end].toreadonly())
            self._bytes_in.inc(block.nbytes)
            if await self.store.put(block):
                stored += 1
            else:
                rejected += 1
        return kvstore_pb2.PutReply(stored=stored, rejected=rejected)

    async def _pool_for(self, mover: str, context: grpc.aio.ServicerContext) -> HostTier:
        """The host tier a reservation for ``mover`` is made in, or the call ends with
        FAILED_PRECONDITION (the client then takes its next mover)."""
        if mover not in MOVERS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"unknown mover {mover!r}; valid: shm (empty), shm-layers, tcp, nixl")
        front = self.store.tiers[0]
        host = front if isinstance(front, HostTier) else None
        if mover in SHARED_MEMORY_MOVERS:
            host = self._shared_pool()
            problem = "" if host is not None else "this node has no shared host pool to write into"
        elif mover == "tcp":
            problem = "this node serves no TCP side channel" if self.endpoints.side is None else ""
        else:
            problem = "this node has no NIXL engine" if self.endpoints.nixl is None else ""
        if host is None or problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem or "this node has no host pool in front")
        assert host is not None
        return host

    async def ReserveShm(self, request: kvstore_pb2.ShmReserveRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.ShmReserveReply:
        host = await self._pool_for(request.mover, context)
        self.reservations.expire()
        slots: list[Slot] = []
        held: list[bool] = []
        pinned: list[BlockKey] = []  # held blocks stay put while room is made for the others
        try:
            for meta in request.blocks:
                key, reservation = BlockKey(bytes(meta.key)), None
                held.append(key in host)
                if held[-1]:
                    self.store.touch(key)
                    self.store.pin(key)
                    pinned.append(key)
                elif 0 < meta.nbytes <= self.settings.max_block_bytes:
                    reservation = await self.store.reserve(meta.nbytes)
                slots.append((meta, reservation))
        finally:
            for key in pinned:
                self.store.unpin(key)
        reply = self._reserve_reply(host, [room for _, room in slots], held)
        landing = None
        if request.mover == "tcp":
            assert self.endpoints.side is not None
            granted = [(meta, room) for meta, room in slots if room is not None and meta is not None]
            token, landed = self.endpoints.side.expect_receive([room.view for _, room in granted],
                                                               [meta.checksum for meta, _ in granted])
            landing = Landing(token, landed)
            reply.side_address, reply.side_token = self.endpoints.side_address, token
        elif request.mover == "nixl":
            assert self.endpoints.nixl is not None
            reply.engine_metadata, reply.pool_base = self.endpoints.nixl.metadata, self.endpoints.nixl.base
        if request.mover not in SHARED_MEMORY_MOVERS:
            reply.pool_path = reply.pool_identity = ""  # nothing to map: the bytes come another way
        lifetime_ms = self.settings.layer_reservation_ms if request.mover == LAYERS_MOVER else self.settings.shm_reservation_ms
        reply.expires_ms = lifetime_ms
        reply.reservation = self.reservations.add(slots, landing, request.mover, lifetime_ms / 1000)
        return reply

    async def CommitShm(self, request: kvstore_pb2.ShmCommitRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.ShmCommitReply:
        pending = self.reservations.take(request.reservation)
        if pending is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"reservation {request.reservation} is unknown or expired")
        assert pending is not None
        slots = pending.slots
        landed: list[bool | None] | None = None
        if pending.landing is not None:  # the payloads came over the side channel, checked as they landed
            results = iter(await self.endpoints.landed(pending.landing, sum(r is not None for _, r in slots)))
            landed = [next(results) if r is not None else None for _, r in slots]
        problem = ""
        if len(request.written) != len(slots):
            problem = f"{len(request.written)} written flags for {len(slots)} reserved blocks"
        elif request.blocks:  # reserved ahead or filled a layer at a time: the headers come now
            if len(request.blocks) != len(slots) or any(
                (r is None and reserved is None) or (r is not None and m.nbytes != r.nbytes)
                or (reserved is not None and m.key != reserved.key)
                for m, (reserved, r) in zip(request.blocks, slots)
            ):
                problem = "the blocks do not match the room reserved"
            slots = [(meta, reservation) for meta, (_, reservation) in zip(request.blocks, slots)]
        if problem:
            for _, reservation in slots:
                if reservation is not None:
                    self.store.release(reservation)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        stored = rejected = 0
        for i, ((meta, reservation), written) in enumerate(zip(slots, request.written)):
            if reservation is None:
                stored += meta is not None and meta.key in self.store.tiers[0]  # held already: nothing was sent
                continue
            if landed is not None and landed[i] is False:
                # Damaged on the side channel: its CRC as it landed is not the header's.
                self.store.metrics.checksum_failures.labels("put").inc()
                self.store.release(reservation)
                rejected += 1
                continue
            if not written or meta is None or (landed is not None and landed[i] is None):
                self.store.release(reservation)
                rejected += meta is not None
                continue
            # Shared memory: not re-read for its CRC: the client copied the very payload the
            # header's CRC was computed from, every reader verifies blocks, and a same-host client
            # can write the pool anyway. The side channel: checked as it landed. NIXL (a one-sided
            # write nobody saw land) and shm-layers (a block written a layer at a time over seconds
            # of prefill): its CRC is computed now. The header is checked in all cases.
            crc = None if pending.mover in CHECKED_AT_COMMIT else meta.checksum
            block = KvBlock.from_meta(meta, reservation.view.toreadonly(), payload_crc=crc)
            self._bytes_in.inc(block.nbytes)
            if await self.store.commit(block, reservation):
                stored += 1
            else:
                rejected += 1
        reply = kvstore_pb2.ShmCommitReply(stored=stored, rejected=rejected)
        if request.reserve_next and (host := self._shared_pool()) is not None:
            ahead = await self._reserve_ahead(host, list(request.reserve_next))
            if ahead is not None:
                reply.next.CopyFrom(ahead)
        return reply

    async def _reserve_ahead(self, host: HostTier, sizes: list[int]) -> kvstore_pb2.ShmReserveReply | None:
        """Room for a client's next put, from spare room only: holding it must not evict anything."""
        held: list[SpaceReservation] = []
        for size in sizes:
            reservation = None
            if 0 < size <= self.settings.max_block_bytes:
                reservation = await self.store.reserve(size, spare_only=True)
            if reservation is None:
                for r in held:
                    self.store.release(r)
                return None
            held.append(reservation)
        reply = self._reserve_reply(host, list(held))
        reply.reservation = self.reservations.add([(None, r) for r in held])
        return reply

    # -- same-GPU moves: CUDA IPC regions (cuda_ipc.py) ----------------------------------

    async def _region(self, raw: bytes, context: grpc.aio.ServicerContext):  # noqa: ANN202 - a DeviceRegion
        from crescent.services.kvstore.cuda_ipc import DeviceRegion, IpcRefused

        try:
            return DeviceRegion.from_bytes(raw)
        except IpcRefused as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _device_refused(self, context: grpc.aio.ServicerContext, why: str) -> None:
        """FAILED_PRECONDITION: the client refuses its mover cuda_ipc for this node, moves host bytes."""
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)

    async def PutRegion(self, request: kvstore_pb2.RegionPutRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.PutReply:
        from crescent.services.kvstore.cuda_ipc import IpcRefused

        if self.store.device_tier() is None:
            await self._device_refused(context, "this node has no GPU tier in front")
        stored = rejected = 0
        for item in request.blocks:
            if item.meta.nbytes > self.settings.max_block_bytes:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a block of {item.meta.nbytes} bytes is over max_block_bytes")
            region = await self._region(item.region, context)
            header = KvBlock.from_meta(item.meta, b"")
            try:
                ok = await self.store.put_from_region(header, region)
            except IpcRefused as exc:  # the blocks before this one are stored; a host put of them is a touch
                await self._device_refused(context, str(exc))
            self._bytes_in.inc(region.nbytes if ok else 0)
            stored, rejected = stored + ok, rejected + (not ok)
        return kvstore_pb2.PutReply(stored=stored, rejected=rejected)

    async def GetRegion(self, request: kvstore_pb2.RegionGetRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.RegionGetReply:
        from crescent.services.kvstore.cuda_ipc import IpcRefused

        if self.store.device_tier() is None:
            await self._device_refused(context, "this node has no GPU tier in front")
        get = request.request
        if len(request.rooms) != len(get.keys):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.rooms)} rooms for {len(get.keys)} keys")
        lease_ms = self._lease_ms(get.lease_ms)
        reply = kvstore_pb2.RegionGetReply()
        for raw_key, raw_room in zip(get.keys, request.rooms):
            key = BlockKey(bytes(raw_key))
            room = await self._region(raw_room, context)
            try:
                header = await self.store.get_into(key, get.model_id or None, room, lease_ms)
            except IpcRefused as exc:
                await self._device_refused(context, str(exc))
            if header is None:
                reply.blocks.add(meta=common_pb2.BlockMeta(key=key, found=False))
                if get.stop_at_first_miss:
                    break
                continue
            meta = meta_of(header)
            meta.nbytes = expected_nbytes(header.dtype, header.shape)  # more than the room's: not copied
            reply.blocks.add(meta=meta)
            self._bytes_out.inc(meta.nbytes if meta.nbytes <= room.nbytes else 0)
        return reply

    async def Replicate(self, request: kvstore_pb2.ReplicateRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.ReplicateReply:
        if not request.target:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "target is required (a peer node id or host:port)")
        blocks, missing = [], 0
        for raw in request.keys:
            block = await self.store.get(BlockKey(bytes(raw)), verify=True)  # the peer's put would refuse a bad one
            if block is None:
                missing += 1
            else:
                self.store.pin(block.key)
                blocks.append(block)
        try:
            result = await self.peers.client(request.target).put(blocks)
        finally:
            for block in blocks:
                self.store.unpin(block.key)
        if result.failed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot reach {request.target}")
        return kvstore_pb2.ReplicateReply(replicated=result.stored, missing=missing)

    async def Remove(self, request: kvstore_pb2.KeysRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.RemoveReply:
        """Drop blocks; with ``crescent-reason: corrupt`` metadata (a reader's report) only the
        copies that fail a check here are dropped, and counted per tier."""
        reported_corrupt = any(
            k == REASON_METADATA and v == REASON_CORRUPT for k, v in (context.invocation_metadata() or ())
        )
        removed = 0
        for raw in request.keys:
            key = BlockKey(bytes(raw))
            removed += await (self.store.recheck(key) if reported_corrupt else self.store.remove(key))
        return kvstore_pb2.RemoveReply(removed=removed)

    # -- operators ------------------------------------------------------------------------

    async def Exists(self, request: kvstore_pb2.KeysRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.ExistsReply:
        return kvstore_pb2.ExistsReply(present=[self.store.exists(BlockKey(bytes(k))) for k in request.keys])

    async def Stat(self, request: kvstore_pb2.StatRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.StatReply:
        reply = kvstore_pb2.StatReply(node_id=self.settings.node_id, leased_blocks=self.store.leased_count())
        if (device := self.store.device_tier()) is not None:
            reply.gpu_uuid = device.gpu_uuid()
        for usage in self.store.usage():
            reply.tiers.add(
                tier=usage.kind, blocks=usage.blocks, bytes=usage.bytes,
                capacity_bytes=usage.capacity_bytes, evictions=usage.evictions, reserved_bytes=usage.reserved_bytes,
            )
        return reply

    async def List(self, request: kvstore_pb2.ListRequest, context: grpc.aio.ServicerContext) -> kvstore_pb2.ListReply:
        limit = request.limit or DEFAULT_LIST_LIMIT
        rows = sorted(
            (key, i, info) for key, i, info in self.store.blocks()
            if key > request.start_after and (not request.tier or self.store.tiers[i].kind == request.tier)
        )
        reply = kvstore_pb2.ListReply(truncated=len(rows) > limit)
        for key, i, info in rows[:limit]:
            reply.blocks.add(
                key=key, parent_key=info.parent_key or b"", model_id=info.model_id, tier=self.store.tiers[i].kind,
                nbytes=info.nbytes, num_tokens=info.num_tokens, leased=self.store.pinned(key),
            )
        return reply
