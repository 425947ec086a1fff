"""Layer-wise kvstore export of the hybrid kimi_k3 cache: a prompt's new full blocks go into the
same-host node's pool while prefill computes, an MLA layer at a time, each block's KDA state
once it is final, committed once whole — what ``layerwise_store.py`` does for the Llama cache.

The stored blocks are the very ones the whole-block export after the prompt stores
(``Engine.block_payload``, ``kimi_k3/cache.py``): latents token-major, after a state where the
block carries one — the prompt's last block, if full, carries the sequence's live state; another
block its page's snapshot if the page still keeps one once the prompt is computed; the rest none.
Whether a block carries a state decides its room's size, so it is settled before room is asked
for, on the engine thread, in the hook of each forward's first layer (the snapshot pool has
planned that forward then, and nothing else plans until it ends):

- **No snapshot** at the forward that completes the block: latents only, final (a page gains no
  snapshot later). Room now; each MLA layer is copied into a scratch slice (``copy_layer``) and
  placed into the room's token-major rows (``LayerLayout.place``) as its hook fires.
- **A snapshot** in a forward before the prompt's last: the pool may still evict it (LRU, a fixed
  number of slots), so the block waits. Evicted at a later forward: latents only, all its layers
  copied at once while that forward computes. Still kept at the last forward: latents and
  snapshot, its layers copied then.
- **Last forward**: its blocks with a snapshot (and the live-state block) stream their layers
  after the state's room; every state is copied out on the engine thread in the hook of the last
  KDA layer of the last forward (``states_after``: final, and no forward can evict it while this
  one runs), then written into the rooms.

Beside a layer-wise handoff of the same prompt (``source``), an MLA layer is copied out of the
cache once: whichever of the two needs it first copies it into the handoff's buffer
(``LayerwiseHandoff.layer_view``), and this export places that slice into its rows. The states
are copied out here either way (the handoff carries the last block's live state alone).

A block's CRC is taken at commit over its room (its bytes in payload order: token-major rows do
not follow the layer order); the node recomputes it over the same room before the block becomes
readable. A node this client cannot write through shared memory (another host or pod: found
out by the first reservation) gets each block whole as soon as it is final and all its layers
are in a buffer of its own (filled the same way), put while later forwards compute. What goes
whole after the prompt (``finished``): blocks without room (the node had none, stale room, no
answer), and a state-carrying block whose state could not be copied. A prompt that stops copies
nothing more and gives its open room back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from crescent.protos import common_pb2
from crescent.services.engine.cache_api import StatefulKvCache
from crescent.services.engine.engine import Engine, Sequence
from crescent.services.instance.wire import kv_dtype
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvstore.movers.shm_layers import LayeredRoom
from crescent.services.kvwire.fused_copy import crc32, empty_buffer
from crescent.services.kvwire.kv_block import KV_FORMAT_VERSION, KvBlock
from crescent.services.prefill.layerwise import hands_off_layerwise, supports_layerwise
from crescent.services.prefill.layerwise_store import LayerSource, StoreExportTask

log = logging.getLogger(__name__)


def stores_hybrid_layerwise(engine: Engine) -> bool:
    """Whether the engine's cache is a hybrid one this export writes (token-major, with states)."""
    return (hands_off_layerwise(engine) and engine.cache.layer_layout().token_major
            and isinstance(engine.cache, StatefulKvCache))


def stores_layerwise(engine: Engine) -> bool:
    """Whether the layer-wise kvstore export applies: a layer-major cache (``LayerwiseStoreExport``)
    or a hybrid one (``HybridLayerwiseStoreExport``)."""
    return supports_layerwise(engine) or stores_hybrid_layerwise(engine)


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a forward's first layer settled: ``streamed`` blocks it completes (block -> carries a
    state), copied a layer at a time; ``evicted`` and ``kept`` waiting blocks, copied whole now
    (latents only; with their snapshot)."""

    streamed: dict[int, bool]
    evicted: list[int]
    kept: list[int]


@dataclass(eq=False)
class _Room:
    """Room reserved for some blocks (slot order), committed together once they are whole."""

    room: LayeredRoom
    blocks: list[int]
    writing: set[int] = field(default_factory=set)  # blocks with a view, not given up


class HybridLayerwiseStoreExport(StoreExportTask):
    """One prompt's new full blocks of a kimi_k3 cache, streamed into the node's pool."""

    def __init__(self, engine: Engine, seq: Sequence, already_cached: int, kvstore: KvStoreClient,
                 source: LayerSource | None = None) -> None:
        """``already_cached``: the prompt's leading tokens that came from a cache (not exported);
        ``source``: the layer-wise handoff of the same prompt, whose layer copies are read instead."""
        cache = engine.cache
        self._engine, self._seq, self._kvstore, self._cache, self._source = engine, seq, kvstore, cache, source
        self.layout = layout = cache.layer_layout()
        self.num_layers = layout.num_layers
        self._page = page = engine.page_size
        self._prompt_tokens = seq.num_tokens
        first = already_cached // page
        self._init_task(first, len(seq.block_keys) if seq.keeps_blocks else first)  # blocks [first, end) are new
        self._states = bool(layout.state_bytes) and layout.states_after is not None
        full_last = self._states and self._prompt_tokens % page == 0  # Engine.block_payload: with the live state
        self._live_block = self._prompt_tokens // page - 1 if full_last else None
        self._last_hook = len(layout.wire_layers) - 1
        self._dtype = kv_dtype(cache)
        # the engine thread's
        self._planned_to = self.first  # blocks below were classified
        self._waiting: set[int] = set()  # blocks with a snapshot the pool may still evict
        self._with_state: list[int] = []  # blocks that carry a state (settled at the last forward)
        # the event loop's
        self._carries: dict[int, bool] = {}  # block -> carries a state (room asked for)
        self._room: dict[int, _Room] = {}  # block -> its room
        self._staged: dict[int, memoryview] = {}  # block -> its own buffer (no shared pool: put whole)
        self._layers = dict.fromkeys(range(self.first, self.end), 0)  # block -> MLA layers in its room
        self._state_in: set[int] = set()
        self._streaming: list[int] = []  # the current forward's streamed blocks
        self._scratch = empty_buffer(layout.layer_bytes(page))
        self._last_layer_seen = False
        self._states_seen = not self._states
        self.bytes_from_cache = 0  # copied out of the cache by this export (not read from ``source``)
        self.events_handled = 0  # hook events this loop has acted on (a test paces the engine by it)

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
            post(self._ready.put_nowait, ("states", self._copy_states(), True))

    def _plan(self, end: int) -> _Plan:
        """Which blocks carry a state, as far as this forward settles it (see the module's doc)."""
        has_snapshot, pages = self._cache.has_snapshot, self._seq.pages
        stop, last = min(self.end, end // self._page), end == self._prompt_tokens
        evicted = sorted(i for i in self._waiting if not has_snapshot(pages[i]))
        self._waiting.difference_update(evicted)
        streamed: dict[int, bool] = {}
        for i in range(self._planned_to, stop):
            snapshot = self._states and has_snapshot(pages[i])
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
        return _Plan(streamed, evicted, kept)

    def _copy_states(self) -> dict[int, memoryview]:
        """The states of the blocks that carry one, final now (the last KDA layer of the last forward)."""
        cache, pages, out = self._cache, self._seq.pages, {}
        for i in self._with_state:
            buffer = empty_buffer(self.layout.state_bytes)
            if i == self._live_block:
                cache.copy_live_state(self._seq.state, buffer)
            elif cache.has_snapshot(pages[i]):
                cache.copy_snapshot(pages[i], buffer)
            else:
                continue  # gone after all: put whole (without it), never with a state not its own
            out[i] = buffer
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

    async def _start_forward(self, plan: _Plan) -> None:
        """Room for the blocks this forward settles; the evicted and kept ones copied whole now."""
        self._carries.update(plan.streamed)
        self._carries.update(dict.fromkeys(plan.evicted, False) | dict.fromkeys(plan.kept, True))
        blocks = sorted([*plan.streamed, *plan.evicted, *plan.kept])
        if blocks and self._kvstore.takes_layers:
            await self._reserve(blocks)
        if blocks and not self._kvstore.takes_layers:  # no shared pool (found out now or before): whole puts
            for i in blocks:
                self._staged[i] = empty_buffer(self._meta(i).nbytes)
        self._streaming = [i for i in plan.streamed if i in self._room or i in self._staged]
        for i in [*plan.evicted, *plan.kept]:
            for layer in range(self.num_layers):
                self._write_layer(i, layer)

    async def _reserve(self, blocks: list[int]) -> None:
        room = await self._kvstore.reserve_layers([self._meta(i) for i in blocks])
        if room is None:
            return  # put whole after the prompt
        chunk = _Room(room, blocks)
        for slot, i in enumerate(blocks):
            if room.held[slot]:
                self._settled.add(i)  # the node has it already: nothing to send
            elif room.views[slot] is not None:
                chunk.writing.add(i)
                self._room[i] = chunk
        if not chunk.writing:
            await room.release()

    def _meta(self, i: int, checksum: int = 0) -> common_pb2.BlockMeta:
        page, keys, carries = self._page, self._seq.block_keys, self._carries[i]
        nbytes = self.layout.layer_bytes(page) * self.num_layers + (self.layout.state_bytes if carries else 0)
        return common_pb2.BlockMeta(
            key=keys[i], parent_key=keys[i - 1] if i else b"", model_id=self._engine.model_id,
            format_version=KV_FORMAT_VERSION, dtype=self._dtype, shape=self._cache.payload_shape(page, with_state=carries),
            token_ids=self._seq.token_ids[i * page : (i + 1) * page], nbytes=nbytes, checksum=checksum, found=True,
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

    def _write_layer(self, i: int, layer: int) -> None:
        """MLA layer ``layer`` of block ``i``: cache -> scratch (or the handoff's copy) -> its rows in
        the room (this thread; the engine thread computes later layers, which never touch this
        page's finished latents)."""
        view = self._view(i)
        if view is None:
            return
        assert self._layers[i] == layer, f"block {i}: layer {layer} after {self._layers[i]}"
        page, head = self._page, self.layout.state_bytes if self._carries[i] else 0
        if self._source is not None:
            piece = self._source.layer_view(i, layer)
        else:
            piece = self._scratch
            self._engine.cache.copy_layer(self._seq.pages[i], layer, page, piece)
            self.bytes_from_cache += len(piece)
        self.layout.place(view[head:], page, layer, piece)
        self._layers[i] = layer + 1
        if i in self._room:  # in the node's room already (a staged block counts when put)
            self._count(len(self._scratch))

    def _write_states(self, states: dict[int, memoryview]) -> None:
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
            view[: self.layout.state_bytes] = states[i]
            self.bytes_from_cache += len(states[i])
            self._state_in.add(i)
            if i in self._room:
                self._count(self.layout.state_bytes)

    def _count(self, nbytes: int) -> None:
        self.bytes_written += nbytes
        if self.computed_at is None:
            self.bytes_early += nbytes

    def _whole(self, i: int) -> bool:
        return self._layers[i] == self.num_layers and (not self._carries[i] or i in self._state_in)

    async def _commit_whole(self) -> None:
        """Commit every room whose blocks being written are all whole (CRC over the room)."""
        for chunk in {id(c): c for c in self._room.values()}.values():
            if not all(self._whole(i) for i in chunk.writing):
                continue
            for i in chunk.blocks:
                self._room.pop(i, None)
            written = [i in chunk.writing for i in chunk.blocks]
            if not any(written):
                await chunk.room.release()
                continue
            headers = [self._meta(i, crc32(view) if ok and view is not None else 0)
                       for i, ok, view in zip(chunk.blocks, written, chunk.room.views)]
            result = await chunk.room.commit(headers, written)
            if result.failed:
                continue  # the node did not answer: put them whole
            done = [i for i in chunk.blocks if i in chunk.writing]
            self._settled.update(done)
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
            crc = crc32(payload)
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

    async def _release_open(self) -> None:
        """Give back room still open (the prompt stopped, or an event never came)."""
        chunks = list({id(c): c for c in self._room.values()}.values())
        self._room = {}
        for chunk in chunks:
            await chunk.room.release()
