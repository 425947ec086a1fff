"""The portable mover: payloads inside the gRPC streams themselves (``Put``, ``Get``), encoded
by ``chunk_wire`` — protobuf's bytes without its copies. Works from anywhere, always last."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from crescent.protos import kvstore_pb2
from crescent.services.kvstore.movers.base import Mover, NodeLink, PutResult
from crescent.services.kvwire import chunk_wire
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import BlockAssembler, BlockFormatError, KvBlock


class GrpcStreamMover(Mover):
    name = "grpc"

    def __init__(self, link: NodeLink, max_chunk_bytes: int) -> None:
        super().__init__(link)
        self.max_chunk_bytes = max_chunk_bytes
        self._put_stream = link.channel.stream_unary(
            "/crescent.v1.KvStore/Put", request_serializer=chunk_wire.encode_chunk,
            response_deserializer=kvstore_pb2.PutReply.FromString,
        )
        self._get_stream = link.channel.unary_stream(
            "/crescent.v1.KvStore/Get", request_serializer=kvstore_pb2.GetRequest.SerializeToString,
            response_deserializer=chunk_wire.decode_chunk,
        )

    async def put(self, blocks: Sequence[KvBlock]) -> PutResult:
        if not blocks:
            return PutResult(0, 0)
        try:
            reply = await self._put_stream(self._chunks(blocks), timeout=self.link.timeout_s)
        except (grpc.aio.AioRpcError, OSError) as exc:
            self.link.failed("put", exc)
            return PutResult(0, len(blocks), failed=True)
        return PutResult(reply.stored, reply.rejected)

    async def _chunks(self, blocks: Sequence[KvBlock]) -> AsyncIterator[chunk_wire.WireChunk]:
        for block in blocks:
            for chunk in chunk_wire.chunks_of_block(block, self.max_chunk_bytes):
                yield chunk

    async def get(self, request: kvstore_pb2.GetRequest, model_id: str | None,
                  corrupt: list[BlockKey]) -> dict[BlockKey, KvBlock]:
        found: dict[BlockKey, KvBlock] = {}
        wanted = set(request.keys)
        assembler = BlockAssembler(replies=True)
        try:
            async for chunk in self._get_stream(request, timeout=self.link.timeout_s):
                if chunk.error:
                    raise BlockFormatError(chunk.error)
                block = assembler.feed(chunk)
                if block is not None and block.key in wanted and self.link.verified(block, model_id, corrupt):
                    found[block.key] = block
        except (grpc.aio.AioRpcError, OSError, BlockFormatError) as exc:
            self.link.failed("get", exc)  # keep what was complete: a prefix stays a prefix
        return found
