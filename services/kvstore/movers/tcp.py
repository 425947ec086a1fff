"""The TCP side channel mover: payloads over a socket of their own, control over gRPC.

*put*: ``ReserveShm`` with mover "tcp" reserves room in the node's host pool and returns the
side channel's address and a one-time token; the payloads go over that socket straight into the
reserved room, where the node checks each one's CRC as it lands and answers which arrived
whole; ``CommitShm`` stores those. *get*: ``GetShm`` with mover "tcp" returns the headers, the
address and a token; the payloads come back over the socket into fresh buffers, checksummed as
they land, so ``verify`` costs no second pass. Works between hosts; blocks the node has no room
for go over ``rest`` (gRPC). See ``kvwire/side_channel.py`` for the channel itself.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence

import grpc

from crescent.protos import kvstore_pb2
from crescent.services.common.tls import PeerTls
from crescent.services.kvstore.movers.base import Mover, NodeLink, PutResult, refused
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.fused_copy import empty_buffer
from crescent.services.kvwire.kv_block import KvBlock
from crescent.services.kvwire.side_channel import SideChannelUnreachable, SideTls
from crescent.services.kvwire.side_channel_client import (
    close_kept_connections,
    dial_target,
    receive_payloads,
    send_payloads,
)

MOVER = "tcp"
GIVE_UP_AFTER = 3  # transfers failed in a row before the side channel is given up for this node


class TcpSideChannelMover(Mover):
    name = MOVER

    def __init__(self, link: NodeLink, rest: Mover, tls: PeerTls | None = None) -> None:
        """``tls``: this process's key pair; the side channel then runs mutual TLS with it when
        the node asks for it (its reply's address says ``tls://``)."""
        super().__init__(link)
        self._rest = rest
        self._side_tls = SideTls(tls) if tls is not None else None
        self._server_name = tls.server_name if tls is not None else ""
        self._failures = 0  # transfers failed in a row

    def _target(self, side_address: str) -> tuple[str, ssl.SSLContext | None]:
        """Where to connect, and with which TLS context: the node's host as we dial it for gRPC
        when it advertises an unspecified one (it listens on every interface)."""
        client_tls = self._side_tls.client() if self._side_tls else None
        return dial_target(side_address, self.link.address, client_tls)

    def _unreachable(self, operation: str, exc: BaseException) -> None:
        """A transfer failed: this call goes another way; the mover is dropped for good when the
        side channel cannot be reached (refused, or a firewall drops the connect: seconds lost
        once, not on every call) or its TLS fails, or after a few failures in a row — not for
        one slow transfer."""
        self.link.failed(operation, exc)
        self._failures += 1
        if isinstance(exc, (SideChannelUnreachable, ssl.SSLError)) or self._failures >= GIVE_UP_AFTER:
            self.give_up(f"cannot use the node's side channel: {exc!r}")

    # -- put ------------------------------------------------------------------------------------

    async def put(self, blocks: Sequence[KvBlock]) -> PutResult | None:
        reply = await self.reserve(blocks, MOVER, "the node serves no TCP side channel")
        if not isinstance(reply, kvstore_pb2.ShmReserveReply):
            return reply
        granted = [i for i, slot in enumerate(reply.slots) if slot.granted]
        others = [b for b, slot in zip(blocks, reply.slots) if not slot.granted and not slot.held]
        written = [False] * len(reply.slots)
        sent = True
        if granted:
            try:
                address, context = self._target(reply.side_address)
                landed = await asyncio.to_thread(
                    send_payloads, address, reply.side_token, [blocks[i].payload for i in granted],
                    timeout_s=self.link.timeout_s, client_tls=context, server_name=self._server_name,
                )
                self._failures = 0
                for i, ok in zip(granted, landed):
                    written[i] = ok
                if not all(landed):
                    self.link.errors["integrity"] += landed.count(False)
            except (OSError, ssl.SSLError) as exc:
                self._unreachable("put_tcp", exc)
                sent = False
        try:  # even after a failed send: the commit gives the room back at once
            committed = await self.link.stub.CommitShm(
                kvstore_pb2.ShmCommitRequest(reservation=reply.reservation, written=written),
                timeout=self.link.timeout_s,
            )
        except (grpc.aio.AioRpcError, OSError) as exc:
            self.link.failed("put_tcp", exc)
            return PutResult(0, len(blocks), failed=True)
        if not sent:
            return None  # this put goes another way
        rest = await self._rest.put(others) if others else PutResult(0, 0)
        return PutResult(committed.stored + rest.stored, committed.rejected + rest.rejected, rest.failed)

    # -- get ------------------------------------------------------------------------------------

    async def get(self, request: kvstore_pb2.GetRequest, model_id: str | None,
                  corrupt: list[BlockKey]) -> dict[BlockKey, KvBlock] | None:
        try:
            reply = await self.link.stub.GetShm(kvstore_pb2.ShmGetRequest(request=request, mover=MOVER),
                                                timeout=self.link.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            if refused(exc):
                self.give_up("the node serves no TCP side channel")
                return None
            self.link.failed("get", exc)  # the node itself did not answer: a miss
            return {}
        metas = [item.meta for item in reply.blocks if item.meta.found]
        if not metas:
            return {}
        buffers = [empty_buffer(meta.nbytes) for meta in metas]
        try:
            address, context = self._target(reply.side_address)
            crcs = await asyncio.to_thread(receive_payloads, address, reply.side_token, buffers,
                                           timeout_s=self.link.timeout_s, client_tls=context,
                                           server_name=self._server_name)
        except (OSError, ssl.SSLError) as exc:
            self._unreachable("get_tcp", exc)
            return None
        self._failures = 0
        found: dict[BlockKey, KvBlock] = {}
        wanted = set(request.keys)
        for meta, payload, crc in zip(metas, buffers, crcs):
            block = KvBlock.from_meta(meta, payload.toreadonly(), payload_crc=crc)
            if block.key in wanted and self.link.verified(block, model_id, corrupt):
                found[block.key] = block
        return found

    async def close(self) -> None:
        # The process's kept side-channel connections (all nodes': they are cheap to open anew).
        close_kept_connections()
