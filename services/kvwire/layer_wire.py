"""A layer-wise handoff's KV on the wire: ``LayerSlice``s sent as prefill computes, assembled
into whole block payloads by decode.

A ``LayerSlice`` carries one layer of consecutive blocks, each block's bytes of that layer (its
tokens' KV of that layer, token after token) one after the other. Where they land in a block's
payload is the cache's ``LayerLayout``: layer after layer (the Llama cache's
``(layers, 2, tokens, heads, dim)``: one contiguous range per layer), or token after token (the
kimi_k3 cache's ``(tokens, mla_layers * latent)``: a layer's bytes are strided, one row per
token). The block payloads are the caches' own, so the kvstore and peers see no new format.

A hybrid model's block may also carry a recurrent state before its latents (``state_bytes``):
in a layer-wise handoff only the prompt's last block does (the state decode continues from), and
it travels apart as a ``HandoffPart.state`` (``BlockChunk`` pieces: it is far larger than a
message), once it is final.

Prefill sends a layer's slice once that layer of a chunk is computed (``prefill/layerwise.py``);
decode feeds every slice to a ``LayerAssembler``, which writes it into the blocks' payload
buffers and accepts each (block, layer) exactly once and in layer order per block, and the state
exactly once. A slice that repeats, skips or reorders a layer, names a block outside the prompt
or has the wrong length is a ``BlockFormatError``; so is a stream that ends with a layer of a
block or the state missing. Decode makes the request runnable only from
``LayerAssembler.payloads()``, never from a partial cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from crescent.protos import decode_pb2
from crescent.services.kvwire.chunk_wire import WireChunk
from crescent.services.kvwire.fused_copy import empty_buffer
from crescent.services.kvwire.kv_block import DEFAULT_MAX_CHUNK_BYTES, BlockAssembler, BlockFormatError


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """How a cache's block payloads split into layers for a layer-wise handoff (``layer_layout()``).

    ``num_layers``: layers with per-token KV, numbered 0.. on the wire (kimi_k3: its MLA layers).
    ``token_layer_bytes``: one token's bytes of one layer. ``token_major``: False, a payload is
    layer after layer; True, token after token with each token's layers back to back.
    ``state_bytes``: a recurrent state a block may carry before its per-token KV (0: none).
    ``wire_layers``: for each layer the model's ``on_layer`` hook names, the wire layer it
    completes (None: a layer without per-token KV, a KDA layer). ``states_after``: the hook
    layer after which a forward's states (snapshots, the live state) are final (None: no states).
    """

    num_layers: int
    token_layer_bytes: int
    wire_layers: tuple[int | None, ...]
    token_major: bool = False
    state_bytes: int = 0
    states_after: int | None = None

    @classmethod
    def layer_major(cls, num_layers: int, token_layer_bytes: int) -> LayerLayout:
        """Every model layer has per-token KV and its bytes lie in one range (the Llama cache)."""
        return cls(num_layers, token_layer_bytes, tuple(range(num_layers)))

    def layer_bytes(self, tokens: int) -> int:
        return tokens * self.token_layer_bytes

    def place(self, latents: memoryview, tokens: int, layer: int, piece: memoryview) -> None:
        """Write ``piece``, layer ``layer``'s bytes of a block of ``tokens`` tokens, into the
        block's per-token KV ``latents`` (its payload after any state)."""
        size = self.layer_bytes(tokens)
        if not self.token_major:
            latents[layer * size : (layer + 1) * size] = piece
            return
        rows = np.frombuffer(latents, dtype=np.uint8, count=tokens * self.num_layers * self.token_layer_bytes)
        rows.reshape(tokens, self.num_layers, self.token_layer_bytes)[:, layer] = np.frombuffer(
            piece, dtype=np.uint8).reshape(tokens, self.token_layer_bytes)


def block_buffers(layout: LayerLayout, layer_bytes: list[int], into: memoryview | None = None
                  ) -> tuple[list[int], list[memoryview]]:
    """(state bytes ahead of each block's KV, each block's payload buffer) of a prompt whose
    blocks hold ``layer_bytes`` per layer: only the last block carries a state (the one decode
    continues from), before its KV. ``into``: the buffers are its consecutive slices (a shared
    memory segment of ``buffers_nbytes`` bytes, ``handoff_shm``), else fresh memory each."""
    heads = [0] * len(layer_bytes)
    if heads:
        heads[-1] = layout.state_bytes
    sizes = [h + b * layout.num_layers for h, b in zip(heads, layer_bytes)]
    if into is None:
        return heads, [empty_buffer(n) for n in sizes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return heads, [into[o : o + n] for o, n in zip(offsets, sizes)]


def buffers_nbytes(layout: LayerLayout, layer_bytes: list[int]) -> int:
    """The bytes of all of ``block_buffers``' buffers together."""
    return sum(layer_bytes) * layout.num_layers + (layout.state_bytes if layer_bytes else 0)


def layer_piece(layout: LayerLayout, latents: memoryview, tokens: int, layer: int) -> memoryview:
    """Layer ``layer``'s bytes of a block of ``tokens`` tokens as they go on the wire (token
    after token), read from the block's per-token KV ``latents``: ``place``'s inverse (a slice
    for a layer-major payload, a gathered copy for a token-major one)."""
    size = layout.layer_bytes(tokens)
    if not layout.token_major:
        return latents[layer * size : (layer + 1) * size]
    rows = np.frombuffer(latents, dtype=np.uint8, count=tokens * layout.num_layers * layout.token_layer_bytes)
    return memoryview(np.ascontiguousarray(rows.reshape(tokens, layout.num_layers, layout.token_layer_bytes)[:, layer])).cast("B")


def block_tokens(index: int, prompt_tokens: int, block_size: int) -> int:
    """Tokens of block ``index`` of a prompt (the last one may be partial)."""
    return min(block_size, prompt_tokens - index * block_size)


def slice_groups(first: int, end: int, bytes_of: list[int], max_bytes: int = DEFAULT_MAX_CHUNK_BYTES
                 ) -> Iterator[tuple[int, int]]:
    """Blocks ``[first, end)`` cut into runs ``[a, b)`` whose layer bytes (``bytes_of[i]`` each)
    stay within ``max_bytes`` (a run holds at least one block): one message each."""
    start, size = first, 0
    for i in range(first, end):
        if i > start and size + bytes_of[i] > max_bytes:
            yield start, i
            start, size = i, 0
        size += bytes_of[i]
    if end > start:
        yield start, end


def layer_slice(layer: int, first: int, pieces: list[memoryview], last_block_tokens: int) -> WireChunk:
    """The slice of ``layer`` for blocks ``first ..`` whose layer bytes are ``pieces`` (joined once
    when the message is written, not before)."""
    meta = decode_pb2.LayerSliceMeta(layer=layer, first_block=first, num_blocks=len(pieces),
                                     last_block_tokens=last_block_tokens, nbytes=sum(len(p) for p in pieces))
    return WireChunk(meta=meta, data=tuple(pieces), last=True)


class LayerAssembler:
    """Whole block payloads of one prompt, from its layer slices in any interleaving that keeps
    each block's layers in order (and, with ``layout.state_bytes``, the last block's state)."""

    def __init__(self, layout: LayerLayout, prompt_tokens: int, block_size: int, into: memoryview | None = None) -> None:
        """``layout``: where each layer's bytes go in a payload (the receiving cache's ``layer_layout``);
        ``into``: the payload buffers lie there (``block_buffers``), a shared memory handoff's."""
        num_layers, token_layer_bytes = layout.num_layers, layout.token_layer_bytes
        if num_layers <= 0 or prompt_tokens <= 0 or block_size <= 0 or token_layer_bytes <= 0:
            raise BlockFormatError(f"layer-wise handoff of {num_layers} layers, {prompt_tokens} tokens, "
                                   f"{block_size}-token blocks, {token_layer_bytes} bytes per token and layer")
        self.layout = layout
        self.num_layers, self.prompt_tokens, self.block_size = num_layers, prompt_tokens, block_size
        self.num_blocks = -(-prompt_tokens // block_size)
        self._layer_bytes = [layout.layer_bytes(block_tokens(i, prompt_tokens, block_size))
                             for i in range(self.num_blocks)]
        self._heads, self._buffers = block_buffers(layout, self._layer_bytes, into)
        self.nbytes = buffers_nbytes(layout, self._layer_bytes)  # of all the buffers: a segment's size
        self._next_layer = [0] * self.num_blocks  # per block: the layer it takes next
        self._state = BlockAssembler()
        self._state_done = layout.state_bytes == 0
        self.received = 0  # payload bytes taken

    def feed_state(self, chunk: WireChunk) -> None:
        """Take one piece of the last block's state (``HandoffPart.state``); ``BlockFormatError``
        when this layout has none, it came already, or its size is not the state's."""
        if not self.layout.state_bytes:
            raise BlockFormatError("a recurrent state in the handoff of a cache without states")
        if self._state_done:
            raise BlockFormatError("the recurrent state arrived again")
        head = self._heads[-1]
        if chunk.meta is not None and chunk.meta.nbytes != head:
            raise BlockFormatError(f"a recurrent state of {chunk.meta.nbytes} bytes; this cache's has {head}")
        if self._state.feed(chunk, into=self._buffers[-1][:head] if chunk.meta is not None else None) is not None:
            self._state_done = True
        self.received += len(chunk.data)

    def feed(self, chunk: WireChunk) -> None:
        """Take one slice; ``BlockFormatError`` when it is not the next layer of each of its blocks."""
        meta = chunk.meta
        if not isinstance(meta, decode_pb2.LayerSliceMeta) or not chunk.last:
            raise BlockFormatError("a layer slice comes in one message, with its meta")
        data = memoryview(chunk.data) if not isinstance(chunk.data, tuple) else memoryview(b"".join(chunk.data))
        self._check_slice(meta, len(data))
        offset = 0
        for block in range(meta.first_block, meta.first_block + meta.num_blocks):
            size = self._layer_bytes[block]
            tokens = block_tokens(block, self.prompt_tokens, self.block_size)
            self.layout.place(self._buffers[block][self._heads[block] :], tokens, meta.layer, data[offset : offset + size])
            offset += size
        self._took(meta)

    def _took(self, meta: decode_pb2.LayerSliceMeta) -> None:
        """The slice ``meta`` names is in its blocks' buffers (checked by ``_check_slice``)."""
        for block in range(meta.first_block, meta.first_block + meta.num_blocks):
            self._next_layer[block] = meta.layer + 1
        self.received += meta.nbytes

    def _check_slice(self, meta: decode_pb2.LayerSliceMeta, nbytes: int) -> None:
        """``BlockFormatError`` unless ``meta`` (with ``nbytes`` of data) is the next layer of
        each of its blocks, all inside the prompt, of the length its blocks' tokens take."""
        layer, first, count = meta.layer, meta.first_block, meta.num_blocks
        if not 0 <= layer < self.num_layers:
            raise BlockFormatError(f"layer {layer} of a {self.num_layers}-layer handoff")
        if count <= 0 or first < 0 or first + count > self.num_blocks:
            raise BlockFormatError(f"blocks [{first}, {first + count}) of a {self.num_blocks}-block prompt")
        last = first + count - 1
        if meta.last_block_tokens != block_tokens(last, self.prompt_tokens, self.block_size):
            raise BlockFormatError(f"block {last} of {meta.last_block_tokens} tokens; the prompt's has "
                                   f"{block_tokens(last, self.prompt_tokens, self.block_size)}")
        expected = sum(self._layer_bytes[first : first + count])
        if nbytes != expected or meta.nbytes != expected:
            raise BlockFormatError(f"layer {layer} of blocks [{first}, {last + 1}): {nbytes} bytes "
                                   f"(meta says {meta.nbytes}), {expected} expected")
        for block in range(first, first + count):
            if self._next_layer[block] != layer:
                what = "again" if layer < self._next_layer[block] else f"before layer {self._next_layer[block]}"
                raise BlockFormatError(f"layer {layer} of block {block} arrived {what}")

    def payloads(self) -> list[memoryview]:
        """Every block's payload (the last one's state first, if the layout has states);
        ``BlockFormatError`` naming the first missing layer, or the missing state, if any."""
        for block, layer in enumerate(self._next_layer):
            if layer != self.num_layers:
                raise BlockFormatError(f"layer {layer} of block {block} never arrived "
                                       f"({self.num_layers} layers, {self.num_blocks} blocks)")
        if not self._state_done:
            raise BlockFormatError("the recurrent state of the last block never arrived")
        return self._buffers
