"""The same-GPU mover: an engine's device blocks go to (and come from) the node's GPU tier through
CUDA IPC regions (``kvstore/cuda_ipc.py``), device to device, no host bounce.

Only for blocks the client holds on a device (``KvStoreClient.put_device``/``get_device``); host
blocks are never its (``put``/``get`` answer None: the next mover takes them). It is tried only
when the node's ``Stat`` names the GPU the blocks are on (its UUID, the same across processes);
a node without a GPU tier, on another GPU, or that answers FAILED_PRECONDITION (IPC refused
there) is refused for good in the client's ``MoverLadder`` and the client moves host bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from crescent.protos import common_pb2, kvstore_pb2
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvstore.cuda_ipc import CUDA_IPC, IpcRefused, RegionOpener
from crescent.services.kvstore.movers.base import Mover, NodeLink, PutResult, refused
from crescent.services.kvwire.kv_block import KvBlock


class CudaIpcMover(Mover):
    name = CUDA_IPC

    def __init__(self, link: NodeLink, opener: RegionOpener | None) -> None:
        """``opener``: how this process exports device memory (None: ``CudaIpc``, made on first use)."""
        super().__init__(link)
        self._opener = opener
        self._node_gpu: str | None = None  # the node's answer, once it gave one

    @property
    def opener(self) -> RegionOpener:
        if self._opener is None:
            from crescent.services.kvstore.cuda_ipc import CudaIpc

            self._opener = CudaIpc()
        return self._opener

    async def put(self, blocks: Sequence[KvBlock]) -> PutResult | None:
        return None  # host bytes: not this mover's

    async def get(self, request: kvstore_pb2.GetRequest, model_id: str | None,
                  corrupt: list[BlockKey]) -> dict[BlockKey, KvBlock] | None:
        return None

    async def _same_gpu(self, tensors: Sequence[Any]) -> bool:
        """Whether the node's GPU tier is on the GPU of ``tensors`` (refused for good if not)."""
        if not self.usable or not tensors:
            return False
        if self._node_gpu is None:
            try:
                reply = await self.link.stub.Stat(kvstore_pb2.StatRequest(), timeout=self.link.timeout_s)
            except (grpc.aio.AioRpcError, OSError) as exc:
                self.link.failed("stat", exc)
                return False  # not now; asked again next time
            self._node_gpu = reply.gpu_uuid
        if not self._node_gpu:
            self.give_up("the node has no GPU tier")
            return False
        mine = {self.opener.gpu_uuid(t.device) for t in tensors}
        if mine != {self._node_gpu}:
            self.give_up(f"the node's GPU tier is on {self._node_gpu}, these blocks on {', '.join(sorted(mine))}")
            return False
        return True

    def _said_no(self, exc: BaseException, operation: str) -> None:
        if refused(exc):
            self.give_up(exc.details() or exc.code().name)  # type: ignore[union-attr]
        else:
            self.link.failed(operation, exc)

    async def put_device(self, headers: Sequence[KvBlock], tensors: Sequence[Any]) -> PutResult | None:
        """Store the blocks of ``headers`` (empty payloads; checksum 0: the node computes it),
        their bytes those of ``tensors`` (contiguous, on the node's GPU). None: put them another way."""
        if not await self._same_gpu(tensors):
            return None
        try:
            items = [kvstore_pb2.RegionBlock(meta=_meta(h, t.numel() * t.element_size()),
                                             region=self.opener.export(t).to_bytes())
                     for h, t in zip(headers, tensors)]
        except IpcRefused as exc:  # this memory cannot be shared (not the node's fault): host bytes this time
            self.link.failed("put", exc)
            return None
        try:
            reply = await self.link.stub.PutRegion(kvstore_pb2.RegionPutRequest(blocks=items), timeout=self.link.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._said_no(exc, "put")
            return None
        return PutResult(reply.stored, reply.rejected)

    async def get_device(self, request: kvstore_pb2.GetRequest, rooms: Sequence[Any]) -> dict[BlockKey, KvBlock] | None:
        """The headers of the blocks found, each one's payload written into its room (one per key,
        in order). None: get them another way."""
        if not await self._same_gpu(rooms):
            return None
        try:
            exported = [self.opener.export(room).to_bytes() for room in rooms]
        except IpcRefused as exc:
            self.link.failed("get", exc)
            return None
        try:
            reply = await self.link.stub.GetRegion(kvstore_pb2.RegionGetRequest(request=request, rooms=exported),
                                                   timeout=self.link.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self._said_no(exc, "get")
            return None
        return {BlockKey(bytes(item.meta.key)): KvBlock.from_meta(item.meta, b"")
                for item in reply.blocks if item.meta.found}


def _meta(header: KvBlock, nbytes: int) -> common_pb2.BlockMeta:
    meta = header.to_meta()
    meta.nbytes = nbytes
    return meta
