"""Layer-wise handoff: a prompt's KV goes to decode a layer at a time while prefill computes
(Mooncake, FAST'25 §3.3), so most of the transfer hides behind the forward passes.

The Handoff stream opens before the prompt is computed: the header (``num_layers`` set, no
first token yet), then the blocks already cached (prefix hits), every layer. The engine calls
``on_layer(layer, end)`` on its thread once a layer's KV of the first ``end`` tokens is in the
cache (``Engine.prefill``/``mixed_step``'s hook); this event loop then copies that layer of the
blocks it completed into the blocks' payload buffers and sends it as ``LayerSlice`` messages
(``kvwire/layer_wire.py``: one join per message, up to 4 MiB each) while the engine computes
the next layers. The first tokens follow in the ``HandoffTail`` once prefill sampled them.

The payload buffers are the ones the kvstore export reads (``PromptExport.adopt``), and the
layer-wise kvstore export takes its layers from them too (``layer_view``): whichever stream
needs a (block, layer) first copies it out of the cache, the other reads that copy, so a block
is copied out of the cache once for both. Where a layer lies in them is the cache's
``LayerLayout``. The hybrid kimi_k3 cache: the wire's layers are its MLA layers (a KDA layer's
hook sends nothing), each copied to a contiguous slice and placed into the token-major payload;
the last block's live state is copied into its buffer in the hook of the prompt's last KDA
layer (engine thread) and goes to decode as ``HandoffPart.state``. A block whose page keeps a
state snapshot once the prompt is computed is not adopted: the export copies it with its
snapshot as the whole-block path does (its latents a second time; decode needs no snapshot, and
the pool bounds how many a prompt holds). Cancelled (decode refused, the caller left), the
stream stops and ``close`` waits for it, so the prompt's pages are never read after release.

Decode on this host (``handoff_mover.py``): the payload buffers lie in one shared memory segment
(``kvwire/handoff_shm.py``) and each slice goes as a note with its CRC32 instead of its bytes.
A decode that cannot map the segment refuses (``HandoffMovers.refused``); the stream then starts again
with the bytes: the header without the segment, every slice sent so far read back from the
buffers, then the rest as it comes. What is ready is kept per layer (``_avail``), not per event,
so a stream stopped between two messages loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
import time
from collections.abc import AsyncIterator

import grpc

from crescent.protos import common_pb2, decode_pb2
from crescent.services.engine.cache_api import LayerCopyingKvCache
from crescent.services.engine.engine import Engine, Sequence
from crescent.services.kvwire.chunk_wire import block_chunks
from crescent.services.kvwire.fused_copy import crc32, empty_buffer
from crescent.services.kvwire.handoff_shm import layer_note, state_note
from crescent.services.kvwire.handoff_tcp import HandoffSender
from crescent.services.kvwire.handoff_wire import HandoffWirePart
from crescent.services.kvwire.kv_block import DEFAULT_MAX_CHUNK_BYTES
from crescent.services.kvwire.layer_wire import (block_buffers, block_tokens, buffers_nbytes, layer_piece,
                                                 layer_slice, slice_groups)
from crescent.services.kvwire.movers import GRPC
from crescent.services.prefill.handoff_mover import SHM, TCP, HandoffMovers
from crescent.services.prefill.prompt_export import PromptExport

OPEN_TIMEOUT_S = 10.0  # decode's OpenHandoff reply
TAIL_TIMEOUT_S = 60.0  # decode's reply after the tail, as a whole handoff's deadline before
STATE = -1  # the event of the last block's state being final (layers are >= 0)


def hands_off_layerwise(engine: Engine) -> bool:
    """Whether the engine's cache can hand a prompt off a layer at a time (both model families).
    A tensor-parallel cache (engine/parallel) has a layout, so its decode takes layer-wise
    handoffs, but no ``copy_layer``: its prefill hands prompts off whole."""
    return isinstance(engine.cache, LayerCopyingKvCache)


def supports_layerwise(engine: Engine) -> bool:
    """Whether the engine's payloads lie layer after layer with no state (the Llama cache): what a
    copy of a layer into one range of a block (the layer-wise kvstore export) needs. The hybrid
    kimi_k3 cache's payloads are token-major with states: it hands off layer-wise (see above)."""
    if not hands_off_layerwise(engine):
        return False
    layout = engine.cache.layer_layout()
    return not layout.token_major and not layout.state_bytes


class LayerwiseHandoff:
    """One prompt's layer-wise handoff: the stream's parts, fed by the engine's layer hook."""

    def __init__(self, engine: Engine, seq: Sequence, export: PromptExport, header: decode_pb2.HandoffHeader,
                 movers: HandoffMovers | None = None, peer: str = "") -> None:
        """``movers``, ``peer``: a shared memory segment for the buffers if the mover to decode
        ``peer`` is shared memory (None: the bytes go on the stream)."""
        self._engine, self._seq, self.export = engine, seq, export
        self.layout = layout = engine.cache.layer_layout()
        self.prompt_tokens = export.prompt_tokens
        self.num_layers = layout.num_layers
        self.num_blocks = export.num_blocks
        self._last_hook = len(layout.wire_layers) - 1
        self._tokens = [block_tokens(i, self.prompt_tokens, engine.block_size) for i in range(self.num_blocks)]
        self._layer_bytes = [layout.layer_bytes(t) for t in self._tokens]
        self._movers, self.peer = movers, peer
        total = buffers_nbytes(layout, self._layer_bytes)
        self.segment = movers.segment(peer, total) if movers is not None else None
        tcp = self.segment is None and movers is not None and movers.uses_tcp(peer)
        flat = self.segment.buf if self.segment is not None else empty_buffer(total) if tcp else None
        self._heads, self._buffers = block_buffers(layout, self._layer_bytes, flat)
        # over TCP: each buffer's offset in the flat buffer, which decode's mirrors
        self._offsets = list(itertools.accumulate((len(b) for b in self._buffers[:-1]), initial=0))
        self._sender: HandoffSender | None = None  # over TCP, once the side channel is open
        self._groups = 0  # over TCP: groups sent (the n-th note's bytes are the n-th group)
        self._state_sent = not layout.state_bytes
        self._state_ready = False  # the last block's state is in its buffer
        self._next_block = [0] * self.num_layers  # per layer: the first block not sent yet
        self._in_buffer: set[tuple[int, int]] = set()  # (block, layer) copied out of the cache already
        self._avail = [0] * self.num_layers  # per layer: the blocks whose layer is in the cache
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()  # a layer (or the state) became ready
        self._generation = 0  # of the stream now sent: a refused one's generator stops at its next step
        self._tail: asyncio.Future[decode_pb2.HandoffTail] = self._loop.create_future()
        self.copied = asyncio.Event()  # every block's payload is in its buffer (or the stream stopped)
        export.filled_by(self.copied)
        header.num_layers = self.num_layers
        if self.segment is not None:
            header.shm_segment, header.shm_identity = self.segment.name, self.segment.identity
        self.header = header
        self.mover = SHM if self.segment is not None else TCP if tcp else GRPC
        self.computed_at: float | None = None  # perf_counter when the prompt's last layer was computed
        self.bytes_sent = 0
        self.bytes_early = 0  # sent before the last layer was computed
        if seq.num_computed:  # cached prefix blocks: every layer is ready now
            for layer in range(self.num_layers):
                self._take(layer, seq.num_computed)
        self._task: asyncio.Task | None = None

    # ---- the engine thread's side ----------------------------------------------------------------

    def on_layer(self, layer: int, end: int) -> None:
        """``Engine``'s hook (on the engine thread): layer ``layer`` of the first ``end`` tokens is
        final (a model layer: ``layout.wire_layers`` says which wire layer it completes, if any)."""
        layout = self.layout
        if end == self.prompt_tokens and layer == self._last_hook:
            self.computed_at = time.perf_counter()
        wire = layout.wire_layers[layer]
        if wire is not None:
            self._loop.call_soon_threadsafe(self._ready, wire, end)
        if layout.state_bytes and layer == layout.states_after and end == self.prompt_tokens:
            # the prompt's last KDA layer ran: its live state is final; cloned on the device now,
            # into the last block's head on the loop's thread (on a GPU, once the clone is done)
            staged = self._engine.cache.stage_live_state(self._seq.state)
            self._loop.call_soon_threadsafe(self._state_copied, staged, end)

    # ---- the stream --------------------------------------------------------------------------

    def start(self, call, open_handoff=None) -> None:  # noqa: ANN001 - a stream-unary, a unary multicallable
        """Open the Handoff call now; its parts come as layers are computed (once more, with the
        bytes, if decode cannot map the shared memory or its side channel failed). Over TCP,
        first ``open_handoff`` (decode's OpenHandoff) and the connection, while the prompt computes."""
        async def send() -> decode_pb2.HandoffReply:
            if self.mover == TCP:
                await self._open_side_channel(open_handoff)
            if self.mover != GRPC:
                try:
                    return await call(self._parts())  # a gRPC call is awaitable, not a coroutine
                except grpc.aio.AioRpcError as exc:
                    assert self._movers is not None
                    if not self._movers.refused(self.peer, exc, self.mover):
                        raise
                    self._unlink()
                    self._stop_sender(abort=True)
                    self.mover = GRPC
            return await call(self._parts())

        self._task = asyncio.create_task(send(), name=f"handoff-{self.header.request_id}")

    async def finish(self, firsts: list[int], finished: list[int]) -> decode_pb2.HandoffReply:
        """Send the first tokens and wait for decode's reply (raises the call's ``AioRpcError``)."""
        assert self._task is not None, "start() first"
        self._tail.set_result(decode_pb2.HandoffTail(first_token_id=firsts[0],
                                                     first_token_ids=firsts if len(firsts) > 1 else [],
                                                     finished_choices=finished))
        reply = await asyncio.wait_for(asyncio.shield(self._task), TAIL_TIMEOUT_S)
        self._stop_sender()
        if self._movers is not None:
            self._movers.handed_off(self.peer, self.mover, self.bytes_sent)
        return reply

    async def close(self) -> None:
        """Stop the stream if it still runs (no handoff wanted, or a failure) and wait for it:
        the pages may go back afterwards."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._task is not None:
            with contextlib.suppress(BaseException):
                await self._task
        self._unlink()  # decode unlinked it when it mapped it, unless it never did
        self._stop_sender(abort=True)
        self.copied.set()

    def _unlink(self) -> None:
        if self.segment is not None:
            self.segment.unlink()

    async def _open_side_channel(self, open_handoff) -> None:  # noqa: ANN001 - a unary multicallable
        """Room on decode's side channel and a connection to it (``kvwire/handoff_tcp.py``); on
        any failure the bytes go on the stream (and, unless it was passing, from now on)."""
        assert self._movers is not None
        try:
            if open_handoff is None:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, None, None,
                                           details="no OpenHandoff to call")
            reply = await open_handoff(decode_pb2.OpenHandoffRequest(
                request_id=self.header.request_id, total_bytes=sum(len(b) for b in self._buffers)),
                timeout=OPEN_TIMEOUT_S)
            address, tls, server_name = self._movers.side_target(self.peer, reply.address)
            self._sender = await asyncio.to_thread(HandoffSender.connect, address, reply.token, tls,
                                                   server_name)
        except (grpc.aio.AioRpcError, OSError, ssl.SSLError) as exc:
            self._movers.tcp_failed(self.peer, exc)
            self.mover = GRPC
            return
        self.header.tcp_token = reply.token

    def _stop_sender(self, abort: bool = False) -> None:
        """Over TCP: close the side channel once its groups are out (``abort``: now)."""
        if self._sender is not None:
            self._sender.close(abort)
            self._sender = None

    async def _parts(self) -> AsyncIterator[HandoffWirePart]:
        """The stream: over shared memory or TCP (``self.mover``), notes; else the bytes, first
        those of every slice an earlier (refused) stream put into the buffers."""
        self._generation += 1
        generation, shm = self._generation, self.mover != GRPC  # notes, not bytes
        header = self.header
        if not shm and (header.shm_segment or header.tcp_token):
            header = decode_pb2.HandoffHeader()
            header.CopyFrom(self.header)
            header.ClearField("shm_segment")
            header.ClearField("shm_identity")
            header.ClearField("tcp_token")
        yield HandoffWirePart(header=header)
        if not shm:
            for part in self._resent():
                yield part
        while True:
            self._changed.clear()  # before looking: a layer ready from here on wakes the wait below
            for layer in range(self.num_layers):
                while self._next_block[layer] < self._sendable(layer):
                    a, b = next(slice_groups(self._next_block[layer], self._sendable(layer),
                                             self._layer_bytes))
                    part, nbytes = self._slice(layer, a, b, shm)
                    self._next_block[layer] = b  # before the yield: a stream stopped there resends it
                    self.bytes_sent += nbytes
                    if self.computed_at is None:
                        self.bytes_early += nbytes
                    yield part
                    if generation != self._generation:
                        return
            if self._state_ready and not self._state_sent:
                for part in self._state_parts(shm):
                    yield part
            if min(self._next_block) >= self.num_blocks and self._state_sent:
                break
            await self._changed.wait()
            if generation != self._generation:
                return  # refused; the stream after it sends from here
        self._adopt_all()
        # shielded: a refused stream's stop spares it
        yield HandoffWirePart(tail=await asyncio.shield(self._tail))

    def _sendable(self, layer: int) -> int:
        """The blocks whose layer ``layer`` may go now: those in the cache, but none past the
        blocks the layer before has gone for (a block's layers go in order)."""
        return min(self._avail[layer], self._next_block[layer - 1]) if layer else self._avail[0]

    def _state_copied(self, staged, end: int) -> None:  # noqa: ANN001 - device_staging.Staged
        staged.copy_into(self._buffers[-1][: self._heads[-1]])
        self._ready(STATE, end)

    def _ready(self, layer: int, end: int) -> None:
        self._take(layer, end)
        self._changed.set()

    def _take(self, layer: int, end: int) -> None:
        if layer == STATE:
            self._state_ready = True
            return
        stop = self.num_blocks if end >= self.prompt_tokens else end // self._engine.block_size
        self._avail[layer] = max(self._avail[layer], stop)

    def _slice(self, layer: int, a: int, b: int, shm: bool) -> tuple[HandoffWirePart, int]:
        """Layer ``layer`` of blocks ``[a, b)``, copied out of the cache: its bytes, or over
        shared memory its note (the CRC32 of the bytes, read while still in cache)."""
        pieces = [self._copy(layer, i) for i in range(a, b)]
        nbytes = sum(len(p) for p in pieces)
        if not shm:
            return HandoffWirePart(layer=layer_slice(layer, a, pieces, self._tokens[b - 1])), nbytes
        crc = 0
        for piece in pieces:
            crc = crc32(piece, crc)
        if self._sender is not None:
            self._send_group(layer, a, pieces)
        return HandoffWirePart(layer=layer_note(layer, a, b - a, self._tokens[b - 1], nbytes, crc)), nbytes

    def _send_group(self, layer: int, first: int, pieces: list[memoryview]) -> None:
        """Over TCP: a slice's pieces (``_copy``'s) to where decode's flat buffer holds them,
        before its note (``STATE`` as ``layer``: the last block's state)."""
        assert self._sender is not None
        self._groups += 1
        if layer == STATE:
            self._sender.send(self._groups, [(self._offsets[-1], pieces[0])])
            return
        layout, heads = self.layout, self._heads
        if not layout.token_major:
            self._sender.send(self._groups, [(self._offsets[i] + heads[i] + layer * len(p), p)
                                             for i, p in enumerate(pieces, start=first)])
            return
        row = layout.token_layer_bytes  # a token-major layer: one row per token, strided in the payload
        groups = [(self._offsets[i] + heads[i] + layer * row, p) for i, p in enumerate(pieces, start=first)]
        self._sender.send(self._groups, groups, row=row, stride=row * layout.num_layers)

    def _resent(self) -> list[HandoffWirePart]:
        """The bytes of every slice already in the buffers (a refused shared memory stream's),
        read back from them, and the state if it was sent."""
        parts = []
        for layer in range(self.num_layers):
            for a, b in slice_groups(0, self._next_block[layer], self._layer_bytes):
                pieces = [layer_piece(self.layout, self._buffers[i][self._heads[i] :], self._tokens[i], layer)
                          for i in range(a, b)]
                parts.append(HandoffWirePart(layer=layer_slice(layer, a, pieces, self._tokens[b - 1])))
        if self._state_sent and self.layout.state_bytes:
            parts += self._state_parts(False, count=False)
        return parts

    def _copy(self, layer: int, block: int) -> memoryview:
        """Layer ``layer`` of block ``block``, out of the cache into its payload buffer unless it
        is there already (this thread; the engine thread computes later layers, which never
        touch this memory), as it goes on the wire. Token-major payloads: into a slice of its
        own first, then placed; once placed, gathered back from the buffer."""
        size, tokens, page = self._layer_bytes[block], self._tokens[block], self._seq.pages[block]
        kv = self._buffers[block][self._heads[block] :]
        copied = (block, layer) in self._in_buffer
        if not self.layout.token_major:
            out = kv[layer * size : (layer + 1) * size]
            if not copied:
                self._engine.cache.copy_layer(page, layer, tokens, out)
        elif copied:
            return layer_piece(self.layout, kv, tokens, layer)
        else:
            out = empty_buffer(size)
            self._engine.cache.copy_layer(page, layer, tokens, out)
            self.layout.place(kv, tokens, layer, out)
        self._in_buffer.add((block, layer))
        return out

    def layer_view(self, block: int, layer: int) -> memoryview:
        """Layer ``layer`` of block ``block`` as on the wire, copied out of the cache into its
        payload buffer now if the stream has not yet: the layer-wise kvstore export's source
        (this event loop's thread; layer ``layer`` of the block is final). A view of the buffer,
        or for a token-major payload a slice of its own."""
        return self._copy(layer, block)

    def block_view(self, block: int) -> memoryview:
        """Block ``block``'s payload buffer (filled by ``layer_view``s and the stream's copies;
        layer after layer: the Llama cache's block payload)."""
        assert not self.layout.token_major and not self._heads[block], "not a whole block payload"
        return self._buffers[block]

    def _state_parts(self, shm: bool, count: bool = True) -> list[HandoffWirePart]:
        """The last block's state, final and in its buffer's head: decode continues from it
        (over shared memory, its note)."""
        head = self._heads[-1]
        meta = common_pb2.BlockMeta(key=f"{self.header.request_id}/state".encode(),
                                    model_id=self.header.model_id, dtype="float32", shape=[head // 4],
                                    nbytes=head, found=True)
        if count:
            self.bytes_sent += head
            if self.computed_at is None:
                self.bytes_early += head
        self._state_sent = True
        if shm:
            if self._sender is not None:
                self._send_group(STATE, 0, [self._buffers[-1][:head]])
            return [HandoffWirePart(state=state_note(meta, crc32(self._buffers[-1][:head])))]
        return [HandoffWirePart(state=chunk)
                for chunk in block_chunks(meta, self._buffers[-1][:head], DEFAULT_MAX_CHUNK_BYTES)]

    def _adopt_all(self) -> None:
        """Every block complete: its buffer becomes the kvstore export's payload too, but for a
        block whose page keeps a snapshot (the export copies it with it, as ``block_payload``)."""
        if self.copied.is_set():
            return  # adopted by a refused stream's generator already
        cache = self._engine.cache
        for i, buffer in enumerate(self._buffers):
            if not self.layout.state_bytes:
                self.export.adopt(i, buffer.toreadonly(), cache.payload_shape(self._tokens[i]))
            elif i == self.num_blocks - 1:
                shape = cache.payload_shape(self._tokens[i], with_state=True)
                self.export.adopt(i, buffer.toreadonly(), shape)
            elif not cache.has_snapshot(self._seq.pages[i]):
                shape = cache.payload_shape(self._tokens[i], with_state=False)
                self.export.adopt(i, buffer.toreadonly(), shape)
        self.copied.set()
