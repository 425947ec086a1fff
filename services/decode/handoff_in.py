"""How a handed-off prompt's KV lands in this decode instance: the four modes of one Handoff stream.

- **whole blocks** (prefill's whole-block handoff): ``HandoffPart.block`` chunks, assembled by
  ``BlockAssembler`` into the cache's block payloads;
- **layer-wise, bytes** (``header.num_layers``): ``LayerSlice``s carry each layer of some blocks,
  written into the blocks' buffers by a ``LayerAssembler`` (``kvwire/layer_wire.py``); the state
  of a hybrid model's last block and the first tokens (``HandoffTail``) come last;
- **layer-wise, shared memory** (``header.shm_segment``): the slices are notes (CRC32, no bytes);
  the bytes are in prefill's segment, mapped here (``kvwire/handoff_shm.py``);
- **layer-wise, TCP** (``header.tcp_token``): the notes' bytes come over this instance's side
  channel (``handoff_side.py``, ``kvwire/handoff_tcp.py``) into the buffer ``OpenHandoff``
  allocated, each note waiting for its group to land.

``land`` reads a stream to its end and returns the header, the payloads and the bytes received,
``problem`` says what makes a landed handoff unusable here (INVALID_ARGUMENT);
malformed input is a ``BlockFormatError`` (INVALID_ARGUMENT), a segment or side channel handoff
this instance cannot take a ``HandoffRefused`` (FAILED_PRECONDITION with the mover's refusal
note: prefill sends it again as bytes). No gRPC here: the servicer maps those to status codes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass

import torch

from crescent.protos import decode_pb2
from crescent.services.decode.handoff_side import HandoffSideChannel
from crescent.services.contract.choices import MAX_CHOICES
from crescent.services.engine.cache_api import LayeredKvCache, StatefulKvCache
from crescent.services.engine.engine import Engine
from crescent.services.instance.wire import block_tensor, kv_dtype
from crescent.services.kvwire.handoff_shm import REFUSAL, HandoffSegment, MappedLayerAssembler, ShmUnusable
from crescent.services.kvwire.handoff_tcp import (TCP_REFUSAL, HandoffLanding, HandoffTcpError,
                                                  LandedLayerAssembler)
from crescent.services.kvwire.handoff_wire import HandoffWirePart
from crescent.services.kvwire.kv_block import BlockAssembler, BlockFormatError
from crescent.services.kvwire.layer_wire import LayerAssembler, block_tokens


def first_tokens(header: decode_pb2.HandoffHeader) -> list[int]:
    """Every choice's first token, in index order."""
    return list(header.first_token_ids) or [header.first_token_id]


def open_choices(header: decode_pb2.HandoffHeader) -> int:
    """Choices left to decode (prefill ended the others at their first token)."""
    return len(first_tokens(header)) - len(set(header.finished_choices))


class HandoffRefused(Exception):
    """This instance cannot take the handoff the way it came (its message starts with the
    mover's refusal note): prefill sends it again with the bytes."""


@dataclass(slots=True)
class LandedHandoff:
    """A stream read to its end: its header (a layer-wise one's tail folded in), every block's
    payload as the cache's tensor, the KV bytes received."""

    header: decode_pb2.HandoffHeader | None
    payloads: list[torch.Tensor]
    received: int


class HandoffIntake:
    """Where this instance's handoffs land (one per servicer; each ``land`` call one stream)."""

    def __init__(self, engine: Engine, shm_handoff: bool = True,
                 side: HandoffSideChannel | None = None) -> None:
        """``shm_handoff``: map a layer-wise handoff's shared memory segment (off: refuse it);
        ``side``: the handoff side channel (TCP) ``OpenHandoff`` opens handoffs on (None: refuse)."""
        self.engine = engine
        self.shm_handoff = shm_handoff
        self.side = side

    async def land(self, parts: AsyncIterable[HandoffWirePart],
                   on_header: Callable[[decode_pb2.HandoffHeader], Awaitable[None]]) -> LandedHandoff:
        """Read ``parts`` to their end; ``on_header`` is awaited once the header came, before any KV
        (refusals the header alone decides: it raises to refuse)."""
        header: decode_pb2.HandoffHeader | None = None
        blocks = BlockAssembler()
        layers: LayerAssembler | None = None  # a layer-wise handoff's (header.num_layers > 0)
        tail: decode_pb2.HandoffTail | None = None
        landing: HandoffLanding | None = None  # a handoff over the side channel's (header.tcp_token)
        payloads: list[torch.Tensor] = []
        received = 0
        try:
            async for part in parts:
                if part.error:
                    raise BlockFormatError(part.error)
                if part.header is not None:
                    if header is not None:
                        raise BlockFormatError("a second handoff header")
                    header = part.header
                    await on_header(header)  # before its KV crosses the wire
                    if header.num_layers:
                        layers, landing = await self._layer_landing(header)
                    continue
                if header is None:
                    raise BlockFormatError("KV block before the handoff header")
                if tail is not None:
                    raise BlockFormatError("a handoff part after the tail")
                if part.tail is not None or part.layer is not None or part.state is not None:
                    if layers is None:
                        raise BlockFormatError("a layer slice, state or tail in a handoff that is not "
                                               "layer-wise")
                    if part.tail is None and landing is not None:
                        await _wait_landed(landing)  # the note's bytes, off the side channel
                    if part.tail is not None:
                        tail = part.tail
                    elif part.state is not None:
                        layers.feed_state(part.state)
                    else:
                        layers.feed(part.layer)
                    continue
                if layers is not None:
                    raise BlockFormatError("a whole block in a layer-wise handoff")
                block = blocks.feed(part.block)
                if block is not None:
                    received += block.nbytes
                    payloads.append(block_tensor(block, block.shape))
            if layers is not None:
                if tail is None:
                    raise BlockFormatError("a layer-wise handoff without its tail (the first tokens)")
                assert header is not None
                header.first_token_id = tail.first_token_id
                header.first_token_ids[:] = tail.first_token_ids
                header.finished_choices[:] = tail.finished_choices
                # every layer of every block, or an error
                payloads = self._layer_payloads(header, layers.payloads())
                received = layers.received
        finally:
            if landing is not None:
                landing.close()  # every note checked (or refused): its connection lands nothing more
        return LandedHandoff(header, payloads, received)

    async def _layer_landing(self, header: decode_pb2.HandoffHeader
                             ) -> tuple[LayerAssembler, HandoffLanding | None]:
        """The assembler of a layer-wise handoff, by mover: bytes, shared memory, or TCP."""
        layers = self._layer_assembler(header)
        if header.shm_segment:
            return await self._mapped_assembler(header, layers), None
        if header.tcp_token:
            return self._landed_assembler(header, layers)
        return layers, None

    def _layer_assembler(self, header: decode_pb2.HandoffHeader) -> LayerAssembler:
        """Where a layer-wise handoff's slices land; its layout must be this cache's."""
        cache = self.engine.cache
        if not isinstance(cache, LayeredKvCache):
            raise BlockFormatError("this decode instance's cache takes no layer-wise handoff")
        layout = cache.layer_layout()
        if (header.kv_dtype != kv_dtype(cache) or tuple(header.kv_block_shape) != cache.block_shape
                or header.num_layers != layout.num_layers):
            raise BlockFormatError(f"KV layout {header.kv_dtype} {tuple(header.kv_block_shape)} in "
                                   f"{header.num_layers} layers != {cache.block_shape} in "
                                   f"{layout.num_layers}")
        return LayerAssembler(layout, len(header.prompt_token_ids), self.engine.block_size)

    async def _mapped_assembler(self, header: decode_pb2.HandoffHeader,
                                layers: LayerAssembler) -> MappedLayerAssembler:
        """The segment of a shared memory handoff, mapped; ``HandoffRefused`` (``REFUSAL``) when
        this process cannot see it or may not map it."""
        if not self.shm_handoff:
            raise HandoffRefused(f"{REFUSAL} turned off on this decode instance")
        try:
            segment = await asyncio.to_thread(HandoffSegment.attach, header.shm_segment, header.shm_identity,
                                              layers.nbytes)
        except ShmUnusable as exc:
            raise HandoffRefused(f"{REFUSAL} {exc}") from exc
        return MappedLayerAssembler(layers.layout, layers.prompt_tokens, layers.block_size, segment)

    def _landed_assembler(self, header: decode_pb2.HandoffHeader,
                          layers: LayerAssembler) -> tuple[LandedLayerAssembler, HandoffLanding]:
        """The buffer OpenHandoff allocated for this handoff, as a mapped assembler's;
        ``HandoffRefused`` (``TCP_REFUSAL``) for a token this instance does not hold (expired)."""
        landing = self.side.take(header.tcp_token, header.request_id) if self.side is not None else None
        if landing is None:
            raise HandoffRefused(f"{TCP_REFUSAL} no side channel handoff of {header.request_id} open here")
        if len(landing.buf) != layers.nbytes:
            landing.close()
            raise BlockFormatError(f"a side channel handoff of {len(landing.buf)} bytes; "
                                   f"the prompt's KV takes {layers.nbytes}")
        assembler = LandedLayerAssembler(layers.layout, layers.prompt_tokens, layers.block_size, landing)
        return assembler, landing

    def problem(self, header: decode_pb2.HandoffHeader, payloads: list[torch.Tensor]) -> str | None:
        """What makes a landed handoff unusable on this instance (None: nothing)."""
        engine = self.engine
        cfg, cache = engine.config, engine.cache
        if header.vllm_cache_salt:
            return ("a vLLM prefill's handoff (its KV in the kvstore, no first tokens) needs a "
                    "vLLM-backed decode")
        if header.model_id != engine.model_id:
            return f"this instance serves {engine.model_id!r}, not {header.model_id!r}"
        prompt_len = len(header.prompt_token_ids)
        if prompt_len == 0 or prompt_len + 1 >= cfg.max_position_embeddings:
            return f"prompt of {prompt_len} tokens does not fit the context window"
        if header.kv_dtype != kv_dtype(cache) or tuple(header.kv_block_shape) != cache.block_shape:
            return f"KV layout {header.kv_dtype} {tuple(header.kv_block_shape)} != {cache.block_shape}"
        firsts = first_tokens(header)
        n = max(header.sampling.n, 1)
        if header.first_token_ids and len(firsts) != n:
            return f"{len(firsts)} first tokens for n = {n}"
        if n > MAX_CHOICES or (n > 1 and header.sampling.first_step > 0):
            return f"n = {n} is not in [1, {MAX_CHOICES}] or is not a new request"
        if any(t < 0 or t >= cfg.vocab_size for t in firsts):
            return f"first token ids must be in [0, {cfg.vocab_size})"
        if not all(0 <= i < len(firsts) for i in header.finished_choices) or open_choices(header) < 1:
            return (f"finished_choices {list(header.finished_choices)} do not leave a choice of "
                    f"{len(firsts)} to decode")
        if len(payloads) != header.num_blocks or len(payloads) != -(-prompt_len // engine.block_size):
            return f"{len(payloads)} KV blocks for a prompt of {prompt_len} tokens"
        try:
            covered = sum(cache.payload_tokens(p.shape) for p in payloads)
        except ValueError as exc:
            return str(exc)
        if covered != prompt_len:
            return "KV blocks do not cover the prompt exactly"
        # recurrent-state models (kimi_k3): the last block carries the state
        if isinstance(cache, StatefulKvCache) and not cache.payload_has_state(payloads[-1].shape):
            return "the last KV block carries no recurrent state to continue from"
        return None

    def _layer_payloads(self, header: decode_pb2.HandoffHeader,
                        buffers: list[memoryview]) -> list[torch.Tensor]:
        """The assembled blocks as the cache's payloads; with states (kimi_k3), the last one carries one."""
        cache, prompt, block_size = self.engine.cache, len(header.prompt_token_ids), self.engine.block_size
        stateful = cache.layer_layout().state_bytes > 0

        def shape(i: int) -> tuple[int, ...]:
            tokens = block_tokens(i, prompt, block_size)
            if stateful:
                return cache.payload_shape(tokens, with_state=i == len(buffers) - 1)
            return cache.payload_shape(tokens)

        return [torch.frombuffer(buffer, dtype=cache.wire_dtype).view(shape(i))
                for i, buffer in enumerate(buffers)]


async def _wait_landed(landing: HandoffLanding) -> None:
    try:
        await landing.wait_next()
    except HandoffTcpError as exc:
        raise HandoffRefused(f"{TCP_REFUSAL} {exc}") from exc
