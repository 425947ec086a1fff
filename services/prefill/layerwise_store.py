"""Layer-wise kvstore export: a prompt's new full blocks go into the node's pool a layer at a
time while prefill computes (Mooncake, FAST'25 §3.3), committed once every layer has landed.

Fed by the engine's per-layer hook like the layer-wise handoff (``layerwise.py``): on the event
loop's thread, each event ``(layer, end)`` copies that layer of the blocks the first ``end``
tokens completed straight from the paged cache into room reserved in the node's shared pool
(``KvStoreClient.reserve_layers``, mover ``shm-layers``: ``cache.copy_layer`` into the mapped
room, one copy, no buffer in between) and takes its CRC while the bytes are in cache. Room is
reserved per chunk, when its first layer is done (the node holds it ``layer_reservation_ms``: a
long prompt may outlive that, one chunk does not); a chunk's blocks are committed with their
CRCs once their last layer has landed, and the node checks each CRC over the room before the
block becomes readable.

What the store never holds: a block with a layer missing or damaged (refused at commit), or
one of a prompt that stopped before the block was whole (``stop``: no copy after it; the room
still open goes back). Blocks that get no room this way (the node had none, or it grew stale
before they were whole) are returned by ``finished`` for the whole-block put after the prompt.

A node this client cannot write through shared memory (another host, another pod: the TCP side
channel, NIXL or gRPC carry its blocks) gets each chunk's new blocks whole as soon as the
chunk's last layer is done, while the next chunk computes (each layer copied into the block's
own buffer as it is done, as the handoff copies): only the last chunk's blocks are left for after
the prompt.
None of this is on the request's path: reservations and commits are awaited by this export's
own task, never by the prompt's computation or its first token.

With a layer-wise handoff streaming the same prompt (``source``), a layer is not copied out of
the cache a second time: it is read from the handoff's payload buffer (``layer_view``, which
copies it out of the cache if the handoff has not yet), into the room; a chunk put whole is the
handoff's buffer itself, no copy at all. Out of a GPU's cache that is one device-to-host copy
per layer instead of two. ``bytes_from_cache`` counts what this export copied out of the cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Protocol

from crescent.protos import common_pb2
from crescent.services.engine.engine import Engine, Sequence
from crescent.services.instance.wire import kv_dtype
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvstore.movers.shm_layers import LayeredRoom
from crescent.services.kvwire.fused_copy import crc32, empty_buffer
from crescent.services.kvwire.kv_block import KV_FORMAT_VERSION, KvBlock

log = logging.getLogger(__name__)


class LayerSource(Protocol):
    """Where a new block's layers are copied out of the cache once (the layer-wise handoff)."""

    def layer_view(self, block: int, layer: int) -> memoryview: ...

    def block_view(self, block: int) -> memoryview: ...


class StoreExportTask:
    """What both layer-wise kvstore exports (this one, kimi_k3's) share: the new blocks
    ``[first, end)``, the events their hook queues, the task that acts on them, and its end."""

    def _init_task(self, first: int, end: int) -> None:
        self.first, self.end = first, end
        self._settled: set[int] = set()  # committed (stored or refused) or held already; the rest go whole
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Queue[tuple | None] = asyncio.Queue()
        self._stopped = False
        self._done: asyncio.Future[list[int]] = self._loop.create_future()
        self.computed_at: float | None = None  # perf_counter when the prompt's last layer was computed
        self.stored = self.rejected = 0
        self.bytes_written = self.bytes_early = 0  # bytes into the node; before the last layer was computed

    @property
    def wanted(self) -> bool:
        return self.end > self.first

    def start(self, spawn: Callable[[Coroutine], None]) -> None:
        """Run the export's task through ``spawn`` (its owner awaits or cancels it)."""
        spawn(self._run())

    def stop(self) -> None:
        """The prompt stopped before it was exported (failed, cancelled): no copy from its pages
        after this returns; room not committed yet goes back."""
        self._stopped = True
        self._ready.put_nowait(None)

    async def close(self) -> None:
        """``stop`` (every copy runs on this loop's thread: none is left in flight)."""
        self.stop()

    async def finished(self) -> list[int]:
        """Once every layer (and state) has been written and committed: the new blocks left to put whole."""
        return await asyncio.shield(self._done)

    async def _run(self) -> None:
        raise NotImplementedError

    async def _release_open(self) -> None:
        raise NotImplementedError

    async def _end(self) -> None:
        """The task's end, however it came: the blocks left to put whole (none once stopped), and
        the room still open given back."""
        if not self._done.done():
            self._done.set_result([] if self._stopped else [i for i in range(self.first, self.end) if i not in self._settled])
        await self._release_open()


@dataclass(eq=False)
class _Chunk:
    """Room reserved for consecutive blocks (one chunk's), committed together."""

    room: LayeredRoom
    first: int  # the block of the room's first slot
    blocks: list[int]  # the blocks written into it (slots with room)


class LayerwiseStoreExport(StoreExportTask):
    """One prompt's new full blocks, streamed to the kvstore a layer at a time."""

    def __init__(self, engine: Engine, seq: Sequence, already_cached: int, kvstore: KvStoreClient,
                 source: LayerSource | None = None) -> None:
        """``already_cached``: the prompt's leading tokens that came from a cache (not exported);
        ``source``: the layer-wise handoff of the same prompt, whose copies are read instead."""
        cache = engine.cache
        self._engine, self._seq, self._kvstore, self._source = engine, seq, kvstore, source
        self.num_layers = cache.num_layers
        self._page = engine.page_size
        first = already_cached // self._page
        self._init_task(first, len(seq.block_keys) if seq.keeps_blocks else first)  # blocks [first, end) are new
        self._layer_bytes = self._page * cache.token_layer_bytes()
        self._shape = cache.payload_shape(self._page)
        self._dtype = kv_dtype(cache)
        self._next_block = [self.first] * self.num_layers  # per layer: the first block not written yet
        self._reserved_to = self.first  # blocks below were offered room
        self._chunk: dict[int, _Chunk] = {}  # block -> the room it is written into
        self._stale: list[_Chunk] = []  # rooms given up, to give back
        self._staged: dict[int, memoryview] = {}  # block -> its payload, filled layer by layer, put whole
        self._layers = dict.fromkeys(range(self.first, self.end), 0)  # block -> layers landed
        self._crc = dict.fromkeys(range(self.first, self.end), 0)
        self.bytes_from_cache = 0  # copied out of the cache by this export (not read from ``source``)
        self._prompt_tokens = seq.num_tokens

    # ---- the engine thread's side ----------------------------------------------------------------

    def on_layer(self, layer: int, end: int) -> None:
        """``Engine``'s hook (on the engine thread): layer ``layer`` of the first ``end`` tokens is final."""
        if end == self._prompt_tokens and layer == self.num_layers - 1:
            self.computed_at = time.perf_counter()
        self._loop.call_soon_threadsafe(self._ready.put_nowait, (layer, end))

    # ---- the event loop's side -------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while not self._stopped and min(self._next_block) < self.end:
                event = await self._ready.get()
                if event is None or self._stopped:
                    break
                layer, end = event
                stop = min(self.end, end // self._page)
                if stop > self._reserved_to:  # a new chunk's blocks: room for them now
                    if self._kvstore.takes_layers:
                        await self._reserve(self._reserved_to, stop)
                    else:  # no shared pool: whole blocks as soon as the chunk is done
                        self._stage(self._reserved_to, stop)
                    self._reserved_to = stop
                    if self._stopped:
                        break
                for i in range(self._next_block[layer], stop):
                    self._write(i, layer)
                self._next_block[layer] = max(self._next_block[layer], stop)
                if layer == self.num_layers - 1 and self._staged:
                    await self._put_staged(stop)
                while self._stale:
                    await self._stale.pop().room.release()
                await self._commit_whole()
        finally:
            await self._end()

    async def _reserve(self, first: int, stop: int) -> None:
        room = await self._kvstore.reserve_layers([self._meta(i) for i in range(first, stop)])
        if room is None and not self._kvstore.takes_layers:  # the node cannot: whole, once the chunk is done
            self._stage(first, stop)
        chunk = _Chunk(room, first, []) if room is not None else None
        for slot, i in enumerate(range(first, stop)):
            if room is not None and room.held[slot]:
                self._settled.add(i)  # the node has it already: nothing to send
            elif chunk is not None and room is not None and room.views[slot] is not None:
                chunk.blocks.append(i)
                self._chunk[i] = chunk
        if chunk is not None and not chunk.blocks:
            await chunk.room.release()

    def _meta(self, i: int, checksum: int = 0) -> common_pb2.BlockMeta:
        page, keys = self._page, self._seq.block_keys
        return common_pb2.BlockMeta(
            key=keys[i], parent_key=keys[i - 1] if i else b"", model_id=self._engine.model_id,
            format_version=KV_FORMAT_VERSION, dtype=self._dtype, shape=self._shape,
            token_ids=self._seq.token_ids[i * page : (i + 1) * page], nbytes=self._layer_bytes * self.num_layers,
            checksum=checksum, found=True,
        )

    def _write(self, i: int, layer: int) -> None:
        """Layer ``layer`` of block ``i``, from the cache into its room (this thread; the engine
        thread computes later layers, which never touch this memory)."""
        chunk = self._chunk.get(i)
        view = self._staged.get(i)
        if chunk is not None:
            if not chunk.room.fresh():  # held up too long: the node may give this room away
                self._abandon(chunk)
                return
            view = chunk.room.views[i - chunk.first]
        if view is None:
            return  # held already, or put whole later
        assert self._layers[i] == layer, f"block {i}: layer {layer} after {self._layers[i]}"
        out = view[layer * self._layer_bytes : (layer + 1) * self._layer_bytes]
        if self._source is None:
            self._engine.cache.copy_layer(self._seq.pages[i], layer, self._page, out)
            self.bytes_from_cache += len(out)
        elif chunk is None:  # staged: ``out`` is a view of the source's buffer
            self._source.layer_view(i, layer)
        else:
            out[:] = self._source.layer_view(i, layer)
        self._crc[i] = crc32(out, self._crc[i])  # still in cache
        self.landed(i, layer, out)
        self._layers[i] = layer + 1
        if chunk is not None:  # in the node's room already (a staged block counts when put)
            self.bytes_written += len(out)
            if self.computed_at is None:
                self.bytes_early += len(out)

    def landed(self, block: int, layer: int, room: memoryview) -> None:
        """Called once a layer is in the room and its CRC taken: a test's way to damage it."""

    def _stage(self, first: int, stop: int) -> None:
        """Blocks ``[first, stop)`` go whole: a buffer each, filled by ``_write`` layer by layer."""
        for i in range(first, stop):
            if self._source is not None:
                self._staged[i] = self._source.block_view(i)
                assert len(self._staged[i]) == self._layer_bytes * self.num_layers, "the handoff's block is another size"
            else:
                self._staged[i] = empty_buffer(self._layer_bytes * self.num_layers)

    async def _put_staged(self, stop: int) -> None:
        """Put the staged blocks below ``stop`` whole, through the client's mover (the TCP side
        channel, NIXL, gRPC), while the next chunk computes."""
        ready = [i for i in self._staged if i < stop and self._layers[i] == self.num_layers]
        if not ready:
            return
        blocks = []
        for i in ready:
            meta = self._meta(i, self._crc[i])
            blocks.append(KvBlock.from_meta(meta, self._staged.pop(i).toreadonly(), payload_crc=self._crc[i]))
        nbytes = sum(b.nbytes for b in blocks)
        early = self.computed_at is None
        result = await self._kvstore.put(blocks)
        if result.failed:
            return  # the node did not answer: put them whole after the prompt
        self._settled.update(ready)
        self.stored += result.stored
        self.rejected += result.rejected
        self.bytes_written += nbytes
        self.bytes_early += nbytes if early else 0

    def _abandon(self, chunk: _Chunk) -> None:
        """Stop writing ``chunk``'s room (stale): its blocks go whole after the prompt, the room back now."""
        for i in chunk.blocks:
            del self._chunk[i]
        self._stale.append(chunk)

    async def _commit_whole(self) -> None:
        """Commit every chunk whose blocks have all their layers."""
        for chunk in {id(c): c for c in self._chunk.values()}.values():
            if not all(self._layers[i] == self.num_layers for i in chunk.blocks):
                continue
            slots = range(chunk.first, chunk.first + len(chunk.room.views))
            headers = [self._meta(i, self._crc[i] if i in chunk.blocks else 0) for i in slots]
            result = await chunk.room.commit(headers, [i in chunk.blocks for i in slots])
            for i in chunk.blocks:
                del self._chunk[i]
            if result.failed:
                continue  # the node did not answer: put them whole
            self._settled.update(chunk.blocks)
            self.stored += result.stored
            self.rejected += result.rejected
            self._kvstore.layers_moved(self._layer_bytes * self.num_layers * len(chunk.blocks))
            if result.rejected:
                log.warning("kvstore refused %d layer-wise blocks at commit (damaged)", result.rejected)

    async def _release_open(self) -> None:
        """Give back room still open (the prompt stopped, or an event never came)."""
        chunks = [*{id(c): c for c in self._chunk.values()}.values(), *self._stale]
        self._chunk, self._stale = {}, []
        for chunk in chunks:
            await chunk.room.release()
