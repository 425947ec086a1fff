"""Layer-wise handoff: a prompt's KV goes to decode a layer at a time while prefill computes
(Mooncake, FAST'25 §3.3), so most of the transfer hides behind the forward passes.

The Handoff stream opens before the prompt is computed: the header (``num_layers`` set, no
first token yet), then the blocks already cached (prefix hits), every layer. The engine calls
``on_layer(layer, end)`` on its thread once a layer's KV of the first ``end`` tokens is in the
cache (``Engine.prefill``/``mixed_step``'s hook); this event loop then copies that layer of the
blocks it completed into the blocks' payload buffers and sends it as ``LayerSlice`` messages
(``kvwire/layer_wire.py``: one join per message, up to 4 MiB each) while the engine computes
the next layers. The first tokens follow in the ``HandoffTail`` once prefill sampled them.

The payload buffers are the ones the kvstore export reads (``PromptExport.adopt``): a block is
still copied out of the cache once for both. Cancelled (decode refused, the caller left), the
stream stops and ``close`` waits for it, so the prompt's pages are never read after release.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from crescent.protos import decode_pb2
from crescent.services.engine.engine import Engine, Sequence
from crescent.services.kvwire.fused_copy import empty_buffer
from crescent.services.kvwire.handoff_wire import HandoffWirePart
from crescent.services.kvwire.layer_wire import block_tokens, layer_slice, slice_groups
from crescent.services.prefill.prompt_export import PromptExport

TAIL_TIMEOUT_S = 60.0  # decode's reply after the tail, as a whole handoff's deadline before


def supports_layerwise(engine: Engine) -> bool:
    """Whether the engine's payloads lie layer after layer (the Llama cache; not yet the hybrid
    kimi_k3 cache, whose payloads are token-major with one state: those go whole)."""
    return hasattr(engine.cache, "copy_layer")


class LayerwiseHandoff:
    """One prompt's layer-wise handoff: the stream's parts, fed by the engine's layer hook."""

    def __init__(self, engine: Engine, seq: Sequence, export: PromptExport, header: decode_pb2.HandoffHeader) -> None:
        cache = engine.cache
        self._engine, self._seq, self.export = engine, seq, export
        self.prompt_tokens = export.prompt_tokens
        self.num_layers = cache.num_layers
        self.num_blocks = export.num_blocks
        per_token = cache.token_layer_bytes()
        self._tokens = [block_tokens(i, self.prompt_tokens, engine.page_size) for i in range(self.num_blocks)]
        self._layer_bytes = [t * per_token for t in self._tokens]
        self._buffers = [empty_buffer(b * self.num_layers) for b in self._layer_bytes]
        self._next_block = [0] * self.num_layers  # per layer: the first block not sent yet
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        self._tail: asyncio.Future[decode_pb2.HandoffTail] = self._loop.create_future()
        self.copied = asyncio.Event()  # every block's payload is in its buffer (or the stream stopped)
        export.filled_by(self.copied)
        header.num_layers = self.num_layers
        self.header = header
        self.computed_at: float | None = None  # perf_counter when the prompt's last layer was computed
        self.bytes_sent = 0
        self.bytes_early = 0  # sent before the last layer was computed
        if seq.num_computed:  # cached prefix blocks: every layer is ready now
            for layer in range(self.num_layers):
                self._ready.put_nowait((layer, seq.num_computed))
        self._task: asyncio.Task | None = None

    # ---- the engine thread's side ----------------------------------------------------------------

    def on_layer(self, layer: int, end: int) -> None:
        """``Engine``'s hook (on the engine thread): layer ``layer`` of the first ``end`` tokens is final."""
        if end == self.prompt_tokens and layer == self.num_layers - 1:
            self.computed_at = time.perf_counter()
        self._loop.call_soon_threadsafe(self._ready.put_nowait, (layer, end))

    # ---- the stream --------------------------------------------------------------------------

    def start(self, call) -> None:  # noqa: ANN001 - a stream-unary multicallable
        """Open the Handoff call now; its parts come as layers are computed."""
        async def send() -> decode_pb2.HandoffReply:
            return await call(self._parts())  # a gRPC call is awaitable, not a coroutine

        self._task = asyncio.create_task(send(), name=f"handoff-{self.header.request_id}")

    async def finish(self, firsts: list[int], finished: list[int]) -> decode_pb2.HandoffReply:
        """Send the first tokens and wait for decode's reply (raises the call's ``AioRpcError``)."""
        assert self._task is not None, "start() first"
        self._tail.set_result(decode_pb2.HandoffTail(first_token_id=firsts[0], first_token_ids=firsts if len(firsts) > 1 else [],
                                                     finished_choices=finished))
        return await asyncio.wait_for(asyncio.shield(self._task), TAIL_TIMEOUT_S)

    async def close(self) -> None:
        """Stop the stream if it still runs (no handoff wanted, or a failure) and wait for it:
        the pages may go back afterwards."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._task is not None:
            with contextlib.suppress(BaseException):
                await self._task
        self.copied.set()

    async def _parts(self) -> AsyncIterator[HandoffWirePart]:
        yield HandoffWirePart(header=self.header)
        while min(self._next_block) < self.num_blocks:
            layer, end = await self._ready.get()
            stop = self.num_blocks if end >= self.prompt_tokens else end // self._engine.page_size
            first = self._next_block[layer]
            for a, b in slice_groups(first, stop, self._layer_bytes):
                pieces = [self._copy(layer, i) for i in range(a, b)]
                part = HandoffWirePart(layer=layer_slice(layer, a, pieces, self._tokens[b - 1]))
                nbytes = sum(len(p) for p in pieces)
                self.bytes_sent += nbytes
                if self.computed_at is None:
                    self.bytes_early += nbytes
                yield part
            self._next_block[layer] = max(first, stop)
        self._adopt_all()
        yield HandoffWirePart(tail=await self._tail)

    def _copy(self, layer: int, block: int) -> memoryview:
        """Layer ``layer`` of block ``block``, out of the cache into its payload buffer (this
        thread; the engine thread computes later layers, which never touch this memory)."""
        size = self._layer_bytes[block]
        out = self._buffers[block][layer * size : (layer + 1) * size]
        self._engine.cache.copy_layer(self._seq.pages[block], layer, self._tokens[block], out)
        return out

    def _adopt_all(self) -> None:
        """Every block complete: its buffer becomes the kvstore export's payload too."""
        cache = self._engine.cache
        for i, buffer in enumerate(self._buffers):
            self.export.adopt(i, buffer.toreadonly(), cache.payload_shape(self._tokens[i]))
        self.copied.set()
