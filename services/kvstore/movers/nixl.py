"""The optional RDMA-capable mover: one-sided writes into the node's pool through NIXL.

``ReserveShm`` with mover "nixl" reserves room and returns the node's agent metadata and its
pool's base address; the payloads are registered with this process's agent and written to
``base + offset`` of each granted slot; ``CommitShm`` stores them (the node verifies each
block's CRC there: a one-sided write has no moment at which the receiver sees it land). Gets go
to the next mover. If NIXL is absent or broken here, or the node has no NIXL engine, the mover
gives up at once and the client uses the next one (see ``kvwire/nixl_engine.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from crescent.protos import kvstore_pb2
from crescent.services.kvstore.movers.base import Mover, NodeLink, PutResult
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.kvwire.nixl_engine import NixlEngine, NixlUnavailable, address_of

MOVER = "nixl"


class NixlMover(Mover):
    name = MOVER

    def __init__(self, link: NodeLink, rest: Mover) -> None:
        super().__init__(link)
        self._rest = rest
        self._engine: NixlEngine | None = None
        try:
            self._engine = NixlEngine("client")
        except NixlUnavailable as exc:
            self.give_up(str(exc))

    async def put(self, blocks: Sequence[KvBlock]) -> PutResult | None:
        if self._engine is None:
            return None
        reply = await self.reserve(blocks, MOVER, "the node has no NIXL engine")
        if not isinstance(reply, kvstore_pb2.ShmReserveReply):
            return reply
        granted = [i for i, slot in enumerate(reply.slots) if slot.granted]
        others = [b for b, slot in zip(blocks, reply.slots) if not slot.granted and not slot.held]
        written = [False] * len(reply.slots)
        if granted:
            local = [(address_of(blocks[i].payload), blocks[i].nbytes) for i in granted]
            remote = [reply.pool_base + reply.slots[i].offset for i in granted]
            try:
                await asyncio.to_thread(self._write, bytes(reply.engine_metadata), local, remote)
                for i in granted:
                    written[i] = True
            except NixlUnavailable as exc:
                self.give_up(str(exc))
        try:
            committed = await self.link.stub.CommitShm(
                kvstore_pb2.ShmCommitRequest(reservation=reply.reservation, written=written),
                timeout=self.link.timeout_s,
            )
        except (grpc.aio.AioRpcError, OSError) as exc:
            self.link.failed("put", exc)
            return PutResult(0, len(blocks), failed=True)
        if granted and not any(written):
            return None  # the room went back: this put goes another way
        rest = await self._rest.put(others) if others else PutResult(0, 0)
        return PutResult(committed.stored + rest.stored, committed.rejected + rest.rejected, rest.failed)

    def _write(self, metadata: bytes, local: list[tuple[int, int]], remote: list[int]) -> None:
        assert self._engine is not None
        # Register each region once: payloads may share one buffer, and the engine takes an
        # overlapping registration badly (a crash, seen with NIXL 1.5.1).
        registered = self._engine.register(sorted(set(local)))
        try:
            self._engine.write(metadata, local, remote, self.link.timeout_s)
        finally:
            self._engine.deregister(registered)

    async def get(self, request: kvstore_pb2.GetRequest, model_id: str | None,
                  corrupt: list[BlockKey]) -> dict[BlockKey, KvBlock] | None:
        return None  # reads take the next mover
