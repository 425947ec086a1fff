"""Blocks written into the node's shared pool a layer at a time, committed once whole.

A layer-wise kvstore export (``prefill/layerwise_store.py``) reserves room for a chunk's new
blocks when its first layer is computed (``ReserveShm`` with mover ``shm-layers``: the headers
without their checksums), copies each layer of each block straight from the paged cache into
that room as the layer finishes, and commits the blocks with their full headers once every
layer has landed (``CommitShm``). The node computes each block's CRC over the room at commit and
stores only blocks whose CRC is the header's: nothing is readable before its commit, and a
damaged layer is refused, never served. A prompt that stops midway gives its room back
(``release``: a commit with nothing written); a client that dies does at the reservation's
expiry. Same host only: the room is written through the pool's mapping (``SharedMemoryMover``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import grpc

from crescent.protos import common_pb2, kvstore_pb2
from crescent.services.kvstore.movers.base import NodeLink, PutResult, refused
from crescent.services.kvstore.movers.shared_memory import SharedMemoryMover

log = logging.getLogger(__name__)

MOVER = "shm-layers"


class LayeredRoom:
    """Pool room for some blocks, filled piece by piece; ``commit`` or ``release`` it once."""

    def __init__(self, link: NodeLink, reply: kvstore_pb2.ShmReserveReply, views: list[memoryview | None],
                 reserved_at: float) -> None:
        self._link, self._reply, self._reserved_at = link, reply, reserved_at
        self.views = views  # per block: its room in the mapped pool (None: no room, or held already)
        self.held = [slot.held for slot in reply.slots]  # the node has these blocks already
        self.open = True

    def fresh(self) -> bool:
        """Whether the room is still safely ours: the node gives it back after ``expires_ms``, so
        a write starts only in the first half of that (a layer's copy takes microseconds)."""
        return time.monotonic() < self._reserved_at + self._reply.expires_ms / 2000

    async def commit(self, headers: Sequence[common_pb2.BlockMeta], written: Sequence[bool]) -> PutResult:
        """Store the blocks ``written`` (their headers with checksums now); the node checks each
        CRC over its room and gives back the rest."""
        self.open = False
        request = kvstore_pb2.ShmCommitRequest(reservation=self._reply.reservation, written=list(written),
                                               blocks=list(headers))
        try:
            reply = await self._link.stub.CommitShm(request, timeout=self._link.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._link.failed("put_layers", exc)
            return PutResult(0, sum(written), failed=True)
        return PutResult(reply.stored, reply.rejected)

    async def release(self) -> None:
        """Give the room back unused (the prompt stopped); the node would after a while anyway."""
        if not self.open:
            return
        self.open = False
        request = kvstore_pb2.ShmCommitRequest(reservation=self._reply.reservation,
                                               written=[False] * len(self._reply.slots))
        try:
            await self._link.stub.CommitShm(request, timeout=self._link.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            log.info("kvstore %s: giving back layer-wise room failed (%s); it expires by itself", self._link.address, exc)


class LayeredPuts:
    """Reserves ``LayeredRoom``s with one node, through the shared-memory mover's pool mapping."""

    name = MOVER

    def __init__(self, shm: SharedMemoryMover) -> None:
        self._shm = shm
        self.usable = True  # False once the node or this client cannot do it: whole-block puts then

    async def reserve(self, metas: Sequence[common_pb2.BlockMeta]) -> LayeredRoom | None:
        """Room for blocks of these headers (checksums not known yet); None when it cannot be
        had this way (then put them whole later)."""
        link = self._shm.link
        if not (self.usable and self._shm.usable):
            return None
        reserved_at = time.monotonic()
        try:
            reply = await link.stub.ReserveShm(kvstore_pb2.ShmReserveRequest(blocks=list(metas), mover=MOVER),
                                               timeout=link.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            if refused(exc) or (isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT):
                self._give_up(f"the node takes no layer-wise puts: {exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc}")
            else:
                link.failed("put_layers", exc)
            return None
        pool = await self._shm.writable_pool(reply.pool_path, reply.pool_identity)
        views: list[memoryview | None] = []
        for meta, slot in zip(metas, reply.slots):
            fits = slot.granted and pool is not None and slot.offset + meta.nbytes <= len(pool)
            views.append(pool[slot.offset : slot.offset + meta.nbytes] if fits else None)
        room = LayeredRoom(link, reply, views, reserved_at)
        if pool is None:
            self._give_up("this client cannot write the node's pool")
            await room.release()
            return None
        return room

    def _give_up(self, why: str) -> None:
        if self.usable:
            log.info("kvstore %s: no layer-wise puts (%s); new blocks go whole after the prompt", self._shm.link.address, why)
        self.usable = False
