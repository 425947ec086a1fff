"""What every mover shares: the gRPC control link to one node, and the mover contract.

A mover moves the payloads of a put or a get; the control calls (reserve, commit, get headers)
always go over the node's authenticated gRPC channel. ``put`` and ``get`` return None when this
mover cannot serve the call — the client then asks the next mover — and ``give_up`` when it
never will for this node (another host, a node without the feature, an optional engine that is
absent or broken): the refusal is kept by the client's ``MoverLadder`` (``kvwire/movers.py``,
the one mover family the layer-wise handoff uses too), so the next calls skip it. Every block a
mover returns has passed ``KvBlock.verify``; a damaged one is a miss, added to ``corrupt`` to be
reported to the node.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from crescent.protos import kvstore_pb2, kvstore_pb2_grpc
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import BlockIntegrityError, KvBlock
from crescent.services.kvwire.movers import MoverLadder, said_no

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PutResult:
    stored: int
    rejected: int
    failed: bool = False  # the store could not be reached: nothing was stored


class NodeLink:
    """The control channel to one node, and the bookkeeping every mover reports into."""

    def __init__(self, address: str, channel: grpc.aio.Channel, timeout_s: float,
                 ladder: MoverLadder) -> None:
        """``ladder``: the client's movers in order, and which of them this node refused."""
        self.address = address
        self.ladder = ladder
        self.channel = channel
        self.stub = kvstore_pb2_grpc.KvStoreStub(channel)
        self.timeout_s = timeout_s
        self.errors: collections.Counter[str] = collections.Counter()  # by operation and "integrity"

    def failed(self, operation: str, exc: BaseException) -> None:
        self.errors[operation] += 1
        if isinstance(exc, grpc.aio.AioRpcError):
            log.warning("kvstore %s %s failed: %s %s", self.address, operation, exc.code().name,
                        exc.details())
        else:
            log.warning("kvstore %s %s failed: %s", self.address, operation, repr(exc))

    def verified(self, block: KvBlock, model_id: str | None, corrupt: list[BlockKey]) -> bool:
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


refused = said_no  # the node cannot do this for us at all, as opposed to a call that failed this time


class Mover:
    """One way of moving payloads to and from one node."""

    name = ""

    def __init__(self, link: NodeLink) -> None:
        self.link = link

    @property
    def usable(self) -> bool:
        """Whether the client still asks this mover (the node has not refused it)."""
        return self.link.ladder.allows(self.link.address, self.name)

    def give_up(self, why: str) -> None:
        """This mover will not work with this node: the client stops asking it."""
        self.link.ladder.refuse(self.link.address, self.name, why)

    async def put(self, blocks: Sequence[KvBlock]) -> PutResult | None:
        raise NotImplementedError

    async def reserve(self, blocks: Sequence[KvBlock], mover: int,
                      missing: str) -> kvstore_pb2.ShmReserveReply | PutResult | None:
        """Room for ``blocks`` in the node's pool, for a mover that writes there itself: the reply,
        or what ``put`` returns instead — None when the node cannot do it (``missing`` says why:
        the client stops asking this mover), a failed result when the node did not answer."""
        try:
            return await self.link.stub.ReserveShm(
                kvstore_pb2.ShmReserveRequest(blocks=[b.to_meta() for b in blocks], mover=mover),
                timeout=self.link.timeout_s,
            )
        except (grpc.aio.AioRpcError, OSError) as exc:
            if refused(exc):
                self.give_up(missing)
                return None
            self.link.failed("put", exc)  # the node itself did not answer: no other way will do better
            return PutResult(0, len(blocks), failed=True)

    async def get(self, request: kvstore_pb2.GetRequest, model_id: str | None,
                  corrupt: list[BlockKey]) -> dict[BlockKey, KvBlock] | None:
        raise NotImplementedError

    async def close(self) -> None:
        """Give back whatever the mover holds (mappings, reserved room)."""
