"""Hot-prefix replication between prefill instances: serving and pulling cached prefix blocks.

When the scheduler places a request on an instance whose own cache holds less of the prompt
than a peer's, the placement names that peer (``prefix_source_id``, and its address in
``prefix_source_address``; the scheduler is asked only when that is empty). The chosen instance asks
the peer for those blocks (``FetchPrefix``), checks each one like a kvstore block, attaches
them to the request and keeps them in its own cache, whose "stored" events then tell the
scheduler that the prefix has one more replica.

The cache is only a cache: a peer that is gone, slow or sends a bad block costs a recompute,
never a wrong answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
import torch

from crescent.protos import prefill_pb2, scheduler_pb2, scheduler_pb2_grpc
from crescent.services.contract.block_keys import BlockKey
from crescent.services.common.grpc_service import ChannelPool, open_channel
from crescent.services.common.tls import PeerTls
from crescent.services.kvwire import chunk_wire
from crescent.services.kvwire.kv_block import BlockAssembler, BlockFormatError, BlockIntegrityError, KvBlock
from crescent.services.common.metrics import EngineMetrics
from crescent.services.engine.engine import Engine, Sequence
from crescent.services.instance.runtime import EngineWorker
from crescent.services.instance.wire import block_matches, block_tensor, page_block

log = logging.getLogger(__name__)

PULL_TIMEOUT_S = 30.0        # a peer busy longer than this is not worth waiting for
READ_BATCH_BLOCKS = 8        # blocks copied per engine call while serving a fetch
DIRECTORY_REFRESH_S = 1.0    # ask the scheduler for peers' addresses at most this often
FETCH_PREFIX_METHOD = "/crescent.v1.Prefill/FetchPrefix"


class PeerDirectory:
    """Instance id → gRPC address of registered prefill instances, from the scheduler."""

    def __init__(self, scheduler_address: str, tls: PeerTls | None = None) -> None:
        self._channel = open_channel(scheduler_address, tls)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._addresses: dict[str, str] = {}
        self._refreshed_at = -float("inf")

    async def address(self, instance_id: str) -> str | None:
        """The address of ``instance_id``, or None when the scheduler does not list it as prefill."""
        if instance_id not in self._addresses and time.monotonic() - self._refreshed_at >= DIRECTORY_REFRESH_S:
            await self._refresh()
        return self._addresses.get(instance_id)

    def forget(self, instance_id: str) -> None:
        """The address did not answer: look it up again next time (the peer may have moved)."""
        self._addresses.pop(instance_id, None)

    async def _refresh(self) -> None:
        self._refreshed_at = time.monotonic()
        try:
            reply = await self._stub.ListInstances(scheduler_pb2.ListInstancesRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            log.warning("cannot list instances at the scheduler: %s", exc.code().name)
            return
        self._addresses = {
            s.info.instance_id: s.info.address for s in reply.instances
            if s.info.role in (scheduler_pb2.INSTANCE_ROLE_PREFILL, scheduler_pb2.INSTANCE_ROLE_AGGREGATED)
        }

    async def close(self) -> None:
        await self._channel.close()


# ---- the source side -----------------------------------------------------------------------

def _read_cached_blocks(engine: Engine, keys: list[BlockKey], token_blocks: list[list[int]],
                        parent: BlockKey | None) -> list[KvBlock]:
    """Copies of the leading ``keys`` the cache holds (runs on the engine thread).

    The pages are referenced while copied, so they cannot be evicted halfway; the lookup also
    refreshes their place in the LRU order: a prefix others fetch is a hot one.
    """
    pages = engine.cache.pages.match_prefix(keys, token_blocks)
    try:
        return [page_block(engine, page, keys[i], keys[i - 1] if i else parent, token_blocks[i])
                for i, page in enumerate(pages)]
    finally:
        engine.cache.pages.release(pages)


async def serve_prefix(engine: Engine, worker: EngineWorker, metrics: EngineMetrics,
                       request: prefill_pb2.FetchPrefixRequest) -> AsyncIterator[chunk_wire.WireChunk]:
    """The chunks of the longest cached run of ``request.block_keys``, a few blocks per engine call
    (encoded by ``chunk_wire``: the servicer is registered with it, see ``add_prefill_to_server``)."""
    block_size = engine.block_size
    keys = [BlockKey(bytes(k)) for k in request.block_keys]
    tokens = list(request.token_ids)
    if len(tokens) != len(keys) * block_size:
        raise ValueError(f"{len(keys)} block keys need {len(keys) * block_size} token ids, got {len(tokens)}")
    start = time.perf_counter()
    sent = nbytes = 0
    while sent < len(keys):
        batch = keys[sent : sent + READ_BATCH_BLOCKS]
        token_blocks = [tokens[(sent + i) * block_size : (sent + i + 1) * block_size] for i in range(len(batch))]
        blocks = await worker.run(_read_cached_blocks, engine, batch, token_blocks, keys[sent - 1] if sent else None)
        for block in blocks:
            for chunk in chunk_wire.chunks_of_block(block):
                yield chunk
            nbytes += block.nbytes
        sent += len(blocks)
        if len(blocks) < len(batch):
            break
    if sent:
        metrics.transfer_bytes.labels("prefill", "to_peer").inc(nbytes)
        metrics.transfer_seconds.labels("prefill", "to_peer").observe(time.perf_counter() - start)
    log.info("served %d of %d requested prefix blocks to a peer", sent, len(keys))


# ---- the pulling side ----------------------------------------------------------------------

class PrefixPuller:
    """Pulls a placement's prefix blocks from a peer prefill instance into this engine."""

    def __init__(self, engine: Engine, worker: EngineWorker, metrics: EngineMetrics, directory: PeerDirectory,
                 tls: PeerTls | None = None) -> None:
        self.engine = engine
        self.worker = worker
        self.metrics = metrics
        self.directory = directory
        self._channels = ChannelPool(tls)
        self._not_prefill: set[str] = set()  # addresses that answered UNIMPLEMENTED to FetchPrefix

    async def close(self) -> None:
        await self._channels.close()
        await self.directory.close()

    def _fetch_call(self, address: str) -> grpc.aio.UnaryStreamMultiCallable:
        """FetchPrefix at ``address``, its replies decoded by ``chunk_wire`` (payloads sliced, not copied)."""
        return self._channels.get(address).unary_stream(
            FETCH_PREFIX_METHOD, request_serializer=prefill_pb2.FetchPrefixRequest.SerializeToString,
            response_deserializer=chunk_wire.decode_chunk,
        )

    async def pull(self, seq: Sequence, source_id: str, source_blocks: int, address: str = "") -> int:
        """Attach the blocks after ``seq``'s local prefix that ``source_id`` holds; returns tokens added.

        ``address``: the source's host:port as the placement gives it; empty: ask the scheduler.
        Returns 0 (and the request computes those tokens) when the source is not a prefill
        instance — e.g. a kvstore node, which the kvstore path reads — or cannot deliver.
        """
        block_size = self.engine.block_size
        first = seq.num_computed // block_size
        end = min(source_blocks, (seq.num_tokens - 1) // block_size, len(seq.block_keys))
        if end <= first:
            return 0
        address = address or await self.directory.address(source_id) or ""
        if not address or address in self._not_prefill:
            log.debug("prefix source %s is not a prefill instance; leaving it to the kvstore path", source_id)
            return 0
        keys = seq.block_keys[first:end]
        start = time.perf_counter()
        try:
            payloads, nbytes = await asyncio.wait_for(self._fetch(address, keys, seq, first), PULL_TIMEOUT_S)
        except (grpc.aio.AioRpcError, TimeoutError, BlockFormatError) as exc:
            reason = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._not_prefill.add(address)  # e.g. a kvstore node: do not ask it again
                log.debug("prefix source %s at %s serves no prefill peers' blocks", source_id, address)
                return 0
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.directory.forget(source_id)
            log.warning("pulling %d prefix blocks from %s failed (%s); computing them", len(keys), source_id, reason)
            return 0
        added = await self.worker.run(self.engine.attach_blocks, seq, payloads) if payloads else 0
        if added:
            self.metrics.transfer_bytes.labels("prefill", "from_peer").inc(nbytes)
            self.metrics.transfer_seconds.labels("prefill", "from_peer").observe(time.perf_counter() - start)
        log.info("pulled %d of %d prefix blocks from %s", added // block_size, len(keys), source_id)
        return added

    async def _fetch(self, address: str, keys: list[BlockKey], seq: Sequence, first: int) -> tuple[list[torch.Tensor], int]:
        block_size = self.engine.block_size
        request = prefill_pb2.FetchPrefixRequest(
            model_id=self.engine.model_id, block_keys=keys,
            token_ids=seq.token_ids[first * block_size : (first + len(keys)) * block_size],
        )
        assembler = BlockAssembler()
        payloads: list[torch.Tensor] = []
        nbytes = 0
        call = self._fetch_call(address)(request, timeout=PULL_TIMEOUT_S)
        try:
            async for chunk in call:
                if chunk.error:
                    raise BlockFormatError(chunk.error)
                block = assembler.feed(chunk)
                if block is None:
                    continue
                i = first + len(payloads)
                if not self._usable(block, keys[len(payloads)] if len(payloads) < len(keys) else None,
                                    seq.token_ids[i * block_size : (i + 1) * block_size]):
                    break
                payloads.append(block_tensor(block, tuple(block.shape)))
                nbytes += block.nbytes
        finally:
            call.cancel()
        return payloads, nbytes

    def _usable(self, block: KvBlock, key: BlockKey | None, tokens: list[int]) -> bool:
        try:
            block.verify(self.engine.model_id)
        except BlockIntegrityError as exc:
            log.warning("peer block rejected: %s", exc)
            return False
        if not block_matches(block, key, tokens, self.engine.cache):
            log.warning("peer block %s does not match the prompt; computing from there", block.key.hex())
            return False
        return True

