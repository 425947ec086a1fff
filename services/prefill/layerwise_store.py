"""Layer-wise kvstore export: a prompt's new full blocks go into the node's pool a layer at a
time while prefill computes (Mooncake, FAST'25 §3.3), committed once whole. One class for every
cache the layer-wise handoff covers; where a layer lies in a block is the cache's ``LayerLayout``
(``kvwire/layer_wire.py``), as for the handoff:

- **layer-major, no state** (the Llama cache): a layer of a block is one range of its payload;
  it is copied from the paged cache straight into that range of the room (one copy, no buffer
  in between) and its CRC taken while the bytes are in cache, layer after layer.
- **token-major, with states** (the hybrid kimi_k3 cache): a layer is copied into a scratch
  slice and placed into the room's token-major rows (``LayerLayout.place``); a block's CRC is
  taken at commit over its room. The stored blocks are the very ones the whole-block export
  stores (``Engine.block_payload``): latents after a state where the block carries one — the
  prompt's last block, if full, the sequence's live state; another block its page's snapshot if
  the page still keeps one once the prompt is computed; the rest none. Whether a block carries a
  state decides its room's size, so it is settled before room is asked for, on the engine
  thread, in the hook of each forward's first layer (``_plan``): no snapshot at the forward that
  completes the block: latents only, room now, streamed; a snapshot before the last forward:
  the block waits (the pool may still evict it) and is copied whole at the forward that evicts
  it, or at the last forward with its snapshot; the states are copied out in the hook of the
  last KDA layer of the last forward (``states_after``), then written into the rooms.

Room is reserved per forward, for the blocks it completes, in its first layer's event (the node
holds it ``layer_reservation_ms``: a long prompt may outlive that, one chunk does not); a room
is committed once its blocks are whole, and the node checks each CRC over the room before the
block becomes readable. The store never holds a block with a layer missing or damaged (refused
at commit), or one of a prompt that stopped before the block was whole (``stop``: no copy after
it; the room still open goes back). Blocks that get no room (the node had none, it grew stale,
no answer), and a state-carrying block whose state could not be copied, are returned by
``finished`` for the whole-block put after the prompt.

A node this client cannot write through shared memory (another host or pod: the TCP side
channel, NIXL or gRPC carry its blocks; found out by the first reservation) gets each block
whole as soon as it is final and all its layers are in a buffer of its own, put while later
forwards compute: only the last forward's blocks are left for after the prompt. None of this is
on the request's path: reservations and commits are awaited by this export's own task.

Beside a layer-wise handoff of the same prompt (``source``), a layer is copied out of the cache
once: whichever of the two needs it first copies it into the handoff's buffer (``layer_view``);
a layer-major block put whole is the handoff's buffer itself, no copy at all. Out of a GPU's
cache that is one device-to-host copy per layer instead of two. ``bytes_from_cache`` counts
what this export copied out of the cache. Every read of a layer's bytes goes through
``read_layer``: the one seam where a device-ordered copy (CUDA events) would plug in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Protocol

from crescent.protos import common_pb2
from crescent.services.engine.cache_api import StatefulKvCache
from crescent.services.engine.device_staging import Staged
from crescent.services.engine.engine import Engine, Sequence
from crescent.services.instance.wire import kv_dtype
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvstore.movers.shm_layers import LayeredRoom
from crescent.services.kvwire.fused_copy import crc32, empty_buffer
from crescent.services.kvwire.kv_block import KV_FORMAT_VERSION, KvBlock
from crescent.services.prefill.layerwise import hands_off_layerwise, supports_layerwise

log = logging.getLogger(__name__)


def stores_layerwise(engine: Engine) -> bool:
    """Whether the layer-wise kvstore export applies: a layer-major cache without states, or a
    token-major one with states (kimi_k3)."""
    if supports_layerwise(engine):
        return True
    return (hands_off_layerwise(engine) and engine.cache.layer_layout().token_major
            and isinstance(engine.cache, StatefulKvCache))


class LayerSource(Protocol):
    """Where a new block's layers are copied out of the cache once (the layer-wise handoff)."""

    def layer_view(self, block: int, layer: int) -> memoryview: ...

    def block_view(self, block: int) -> memoryview: ...


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a forward's first layer settled: ``streamed`` blocks it completes (block -> carries a
    state), copied a layer at a time; ``evicted`` and ``kept`` waiting blocks, copied whole now
    (latents only; with their snapshot); ``stop``: the blocks below are complete."""

    streamed: dict[int, bool]
    evicted: list[int]
    kept: list[int]
    stop: int


@dataclass(eq=False)
class _Room:
    """Room reserved for some blocks (slot order), committed together once they are whole."""

    room: LayeredRoom
    blocks: list[int]
    writing: set[int] = field(default_factory=set)  # blocks with a view, not given up


class LayerwiseStoreExport:
    """One prompt's new full blocks, streamed into the kvstore a layer at a time."""

    def __init__(self, engine: Engine, seq: Sequence, already_cached: int, kvstore: KvStoreClient,
                 source: LayerSource | None = None) -> None:
        """``already_cached``: the prompt's leading tokens that came from a cache (not exported);
        ``source``: the layer-wise handoff of the same prompt, whose layer copies are read instead."""
        cache = engine.cache
        self._engine, self._seq, self._kvstore, self._source = engine, seq, kvstore, source
        self._cache = cache
        self.layout = layout = cache.layer_layout()
        self.num_layers = layout.num_layers
        self._block_size = block_size = engine.block_size
        self._prompt_tokens = seq.num_tokens
        self.first = already_cached // block_size
        self.end = len(seq.block_keys) if seq.keeps_blocks else self.first  # blocks [first, end) are new
        self._stateful = isinstance(cache, StatefulKvCache)
        self._states = bool(layout.state_bytes) and layout.states_after is not None
        # Engine.block_payload: a full last block carries the live state
        full_last = self._states and self._prompt_tokens % block_size == 0
        self._live_block = self._prompt_tokens // block_size - 1 if full_last else None
        # layer-major without states: a layer is one range of the payload, its CRC taken as it lands
        self._ranges = not layout.token_major and not layout.state_bytes
        self._last_hook = len(layout.wire_layers) - 1
        self._dtype = kv_dtype(cache)
        self._layer_size = layout.layer_bytes(block_size)
        # the engine thread's
        self._planned_to = self.first  # blocks below were classified
        self._waiting: set[int] = set()  # blocks with a snapshot the pool may still evict
        self._with_state: list[int] = []  # blocks that carry a state (settled at the last forward)
        # the event loop's
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Queue[tuple | None] = asyncio.Queue()
        self._stopped = False
        self._done: asyncio.Future[list[int]] = self._loop.create_future()
        self._settled: set[int] = set()  # committed (stored or refused) or held already; the rest go whole
        self._carries: dict[int, bool] = {}  # block -> carries a state (room asked for)
        self._room: dict[int, _Room] = {}  # block -> its room
        self._staged: dict[int, memoryview] = {}  # block -> its own buffer (no shared pool: put whole)
        self._on_source: set[int] = set()  # staged blocks whose buffer is the handoff's own
        self._layers = dict.fromkeys(range(self.first, self.end), 0)  # block -> layers landed
        self._crc = dict.fromkeys(range(self.first, self.end), 0)  # layer-major: CRC so far
        self._next_block = [self.first] * self.num_layers  # per layer: the first block not written yet
        self._state_in: set[int] = set()
        self._streaming: list[int] = []  # the current forward's streamed blocks
        self._forward_stop = self.first
        self._scratch = empty_buffer(self._layer_size) if not self._ranges else None
        self._last_layer_seen = False
        self._states_seen = not self._states
        self.computed_at: float | None = None  # perf_counter when the prompt's last layer was computed
        self.stored = self.rejected = 0
        self.bytes_written = self.bytes_early = 0  # bytes into the node; before the last layer was computed
        self.bytes_from_cache = 0  # copied out of the cache by this export (not read from ``source``)
        self.events_handled = 0  # hook events this loop has acted on (a test paces the engine by it)

    # ---- its owner's side --------------------------------------------------------------------

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

    def landed(self, block: int, layer: int, room: memoryview) -> None:
        """Called once a layer-major layer is in the room and its CRC taken: a test's way to damage it."""

    # ---- the engine thread's side ----------------------------------------------------------------

    def on_layer(self, layer: int, end: int) -> None:
        """``Engine``'s hook (on the engine thread): model layer ``layer`` of the first ``end`` tokens ran."""
        layout, last = self.layout, end == self._prompt_tokens
        post = self._loop.call_soon_threadsafe
        if last and layer == self._last_hook:
            self.computed_at = time.perf_counter()
        if layer == 0:
            post(self._ready.put_nowait, ("plan", self._plan(end), last))
        wire = layout.wire_layers[layer]
        if wire is not None:
            post(self._ready.put_nowait, ("layer", wire, last))
        if last and self._states and layer == layout.states_after:
            post(self._ready.put_nowait, ("states", self._stage_states(), True))

    def _plan(self, end: int) -> _Plan:
        """Which blocks this forward completes, and which carry a state (see the module's doc)."""
        stop, last = min(self.end, end // self._block_size), end == self._prompt_tokens
        if not self._states:  # every block completed is final now
            streamed = dict.fromkeys(range(self._planned_to, stop), False)
            self._planned_to = max(self._planned_to, stop)
            return _Plan(streamed, [], [], stop)
        has_snapshot, pages = self._cache.has_snapshot, self._seq.pages
        evicted = sorted(i for i in self._waiting if not has_snapshot(pages[i]))
        self._waiting.difference_update(evicted)
        streamed: dict[int, bool] = {}
        for i in range(self._planned_to, stop):
            snapshot = has_snapshot(pages[i])
            if last and (i == self._live_block or snapshot):
                streamed[i] = True
            elif snapshot:
                self._waiting.add(i)
            else:
                streamed[i] = False
        self._planned_to = max(self._planned_to, stop)
        kept: list[int] = []
        if last:
            kept, self._waiting = sorted(self._waiting), set()
            self._with_state = [i for i, carries in streamed.items() if carries] + kept
        return _Plan(streamed, evicted, kept, stop)

    def _stage_states(self) -> dict[int, Staged]:
        """The states of the blocks that carry one, final now (the last KDA layer of the last
        forward): cloned on the device (engine thread, no wait), copied out by ``_write_states``."""
        cache, pages, out = self._cache, self._seq.pages, {}
        for i in self._with_state:
            if i == self._live_block:
                out[i] = cache.stage_live_state(self._seq.state)
            elif cache.has_snapshot(pages[i]):
                out[i] = cache.stage_snapshot(pages[i])
            # else: gone after all: put whole (without it), never with a state not its own
        return out

    # ---- the event loop's side -------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while not self._stopped and not (self._last_layer_seen and self._states_seen):
                event = await self._ready.get()
                if event is None or self._stopped:
                    break
                kind, what, last = event
                if kind == "plan":
                    await self._start_forward(what)
                elif kind == "layer":
                    for i in self._streaming:
                        self._write_layer(i, what)
                    self._next_block[what] = max(self._next_block[what], self._forward_stop)
                    self._last_layer_seen = last and what == self.num_layers - 1
                else:
                    self._write_states(what)
                    self._states_seen = True
                if self._stopped:
                    break
                await self._commit_whole()
                await self._put_staged()
                self.events_handled += 1
        finally:
            await self._end()

    async def _end(self) -> None:
        """The task's end, however it came: the blocks left to put whole (none once stopped), and
        the room still open given back."""
        if not self._done.done():
            left = [] if self._stopped else [i for i in range(self.first, self.end) if i not in self._settled]
            self._done.set_result(left)
        chunks = list({id(c): c for c in self._room.values()}.values())
        self._room = {}
        for chunk in chunks:
            await chunk.room.release()

    async def _start_forward(self, plan: _Plan) -> None:
        """Room for the blocks this forward settles; the evicted and kept ones copied whole now."""
        self._carries.update(plan.streamed)
        self._carries.update(dict.fromkeys(plan.evicted, False) | dict.fromkeys(plan.kept, True))
        self._forward_stop = max(self._forward_stop, plan.stop)
        blocks = sorted([*plan.streamed, *plan.evicted, *plan.kept])
        if blocks and self._kvstore.takes_layers:
            await self._reserve(blocks)
        if blocks and not self._kvstore.takes_layers:  # no shared pool (found out now or before): whole puts
            for i in blocks:
                self._stage(i)
        self._streaming = [i for i in plan.streamed if i in self._room or i in self._staged]
        for i in [*plan.evicted, *plan.kept]:
            for layer in range(self.num_layers):
                self._write_layer(i, layer)

    async def _reserve(self, blocks: list[int]) -> None:
        room = await self._kvstore.reserve_layers([self._meta(i) for i in blocks])
        if room is None:
            return  # put whole after the prompt (or, the node found unable now, staged by the caller)
        chunk = _Room(room, blocks)
        for slot, i in enumerate(blocks):
            if room.held[slot]:
                self._settled.add(i)  # the node has it already: nothing to send
            elif room.views[slot] is not None:
                chunk.writing.add(i)
                self._room[i] = chunk
        if not chunk.writing:
            await room.release()

    def _stage(self, i: int) -> None:
        """Block ``i`` goes whole: a buffer of its own (a layer-major block beside a handoff: the
        handoff's buffer itself), filled by ``_write_layer`` layer by layer."""
        if self._ranges and self._source is not None:
            self._staged[i] = self._source.block_view(i)
            self._on_source.add(i)
            assert len(self._staged[i]) == self._meta(i).nbytes, "the handoff's block is another size"
        else:
            self._staged[i] = empty_buffer(self._meta(i).nbytes)

    def _meta(self, i: int, checksum: int = 0) -> common_pb2.BlockMeta:
        block_size, keys, carries = self._block_size, self._seq.block_keys, self._carries.get(i, False)
        nbytes = self._layer_size * self.num_layers + (self.layout.state_bytes if carries else 0)
        cache = self._cache
        shape = cache.payload_shape(block_size, with_state=carries) if self._stateful else cache.payload_shape(block_size)
        return common_pb2.BlockMeta(
            key=keys[i], parent_key=keys[i - 1] if i else b"", model_id=self._engine.model_id,
            format_version=KV_FORMAT_VERSION, dtype=self._dtype, shape=shape,
            token_ids=self._seq.token_ids[i * block_size : (i + 1) * block_size], nbytes=nbytes, checksum=checksum,
            found=True,
        )

    def _view(self, i: int) -> memoryview | None:
        """Block ``i``'s room, if it is still being written and still safely ours (or its own buffer)."""
        if i in self._staged:
            return self._staged[i]
        chunk = self._room.get(i)
        if chunk is None or i not in chunk.writing:
            return None
        if not chunk.room.fresh():  # held up too long: the node may give this room away
            chunk.writing.clear()
            return None
        return chunk.room.views[chunk.blocks.index(i)]

    def read_layer(self, block: int, layer: int, out: memoryview) -> memoryview:
        """Layer ``layer`` of block ``block`` as on the wire (its tokens' KV of that layer, token
        after token; the layer is final): the handoff's copy if one streams beside, else copied
        out of the cache into ``out`` (this thread; the engine thread computes later layers,
        which never touch this page's finished ones). The one place this export reads the cache."""
        if self._source is not None:
            return self._source.layer_view(block, layer)
        self._engine.cache.copy_layer(self._seq.pages[block], layer, self._block_size, out)
        self.bytes_from_cache += len(out)
        return out

    def _write_layer(self, i: int, layer: int) -> None:
        """Layer ``layer`` of block ``i`` into its room (or buffer)."""
        view = self._view(i)
        if view is None:
            return
        assert self._layers[i] == layer, f"block {i}: layer {layer} after {self._layers[i]}"
        if self._ranges:
            out = view[layer * self._layer_size : (layer + 1) * self._layer_size]
            piece = self.read_layer(i, layer, out)
            if piece is not out and i not in self._on_source:  # the handoff's buffer is this block's own
                out[:] = piece
            self._crc[i] = crc32(out, self._crc[i])  # still in cache
            self.landed(i, layer, out)
        else:
            assert self._scratch is not None
            head = self.layout.state_bytes if self._carries[i] else 0
            piece = self.read_layer(i, layer, self._scratch)
            self.layout.place(view[head:], self._block_size, layer, piece)
        self._layers[i] = layer + 1
        if i in self._room:  # in the node's room already (a staged block counts when put)
            self._count(self._layer_size)

    def _write_states(self, states: dict[int, Staged]) -> None:
        for i in (i for i, carries in self._carries.items() if carries):
            view = self._view(i)
            if view is None:
                continue
            if i not in states:  # its snapshot was gone: whole after the prompt
                if i in self._staged:
                    del self._staged[i]
                else:
                    self._room[i].writing.discard(i)
                continue
            states[i].copy_into(view[: self.layout.state_bytes])  # after its fence (device_staging.py)
            self.bytes_from_cache += self.layout.state_bytes
            self._state_in.add(i)
            if i in self._room:
                self._count(self.layout.state_bytes)

    def _count(self, nbytes: int) -> None:
        self.bytes_written += nbytes
        if self.computed_at is None:
            self.bytes_early += nbytes

    def _whole(self, i: int) -> bool:
        return self._layers[i] == self.num_layers and (not self._carries.get(i) or i in self._state_in)

    def _checksum(self, i: int, view: memoryview) -> int:
        """Block ``i``'s CRC: taken as its layers landed (layer-major), else over its room now
        (token-major rows do not follow the layer order)."""
        return self._crc[i] if self._ranges else crc32(view)

    async def _commit_whole(self) -> None:
        """Commit every room whose blocks being written are all whole."""
        for chunk in {id(c): c for c in self._room.values()}.values():
            if not all(self._whole(i) for i in chunk.writing):
                continue
            for i in chunk.blocks:
                self._room.pop(i, None)
            written = [i in chunk.writing for i in chunk.blocks]
            if not any(written):
                await chunk.room.release()
                continue
            headers = [self._meta(i, self._checksum(i, view) if ok and view is not None else 0)
                       for i, ok, view in zip(chunk.blocks, written, chunk.room.views)]
            result = await chunk.room.commit(headers, written)
            if result.failed:
                continue  # the node did not answer: put them whole
            self._settled.update(i for i in chunk.blocks if i in chunk.writing)
            self.stored += result.stored
            self.rejected += result.rejected
            self._kvstore.layers_moved(sum(h.nbytes for h, ok in zip(headers, written) if ok))
            if result.rejected:
                log.warning("kvstore refused %d layer-wise blocks at commit (damaged)", result.rejected)

    async def _put_staged(self) -> None:
        """Put the staged blocks that are whole, through the client's mover (the TCP side channel,
        NIXL, gRPC), while later forwards compute."""
        ready = [i for i in self._staged if self._whole(i)]
        if not ready:
            return
        blocks = []
        for i in ready:
            payload = self._staged.pop(i).toreadonly()
            crc = self._checksum(i, payload)
            blocks.append(KvBlock.from_meta(self._meta(i, crc), payload, payload_crc=crc))
        early = self.computed_at is None
        result = await self._kvstore.put(blocks)
        if result.failed:
            return  # the node did not answer: put them whole after the prompt
        self._settled.update(ready)
        self.stored += result.stored
        self.rejected += result.rejected
        nbytes = sum(b.nbytes for b in blocks)
        self.bytes_written += nbytes
        self.bytes_early += nbytes if early else 0
