"""A layer-wise handoff's KV on the wire: ``LayerSlice``s sent as prefill computes, assembled
into whole block payloads by decode.

A block payload whose layers lie back to back (layer 0's bytes first; the Llama cache's
``(layers, 2, tokens, heads, dim)``) can travel a layer at a time: a ``LayerSlice`` carries one
layer of consecutive blocks, each block's layer bytes one after the other. Prefill sends a
layer's slice once that layer of a chunk is computed (``prefill/layerwise.py``); decode feeds
every slice to a ``LayerAssembler``, which writes it into the blocks' payload buffers and
accepts each (block, layer) exactly once and in layer order per block. A slice that repeats,
skips or reorders a layer, names a block outside the prompt or has the wrong length is a
``BlockFormatError``; so is a stream that ends with a layer of a block missing. Decode makes the
request runnable only from ``LayerAssembler.payloads()``, never from a partial cache.
"""

from __future__ import annotations

from collections.abc import Iterator

from crescent.protos import decode_pb2
from crescent.services.kvwire.chunk_wire import WireChunk
from crescent.services.kvwire.fused_copy import empty_buffer
from crescent.services.kvwire.kv_block import DEFAULT_MAX_CHUNK_BYTES, BlockFormatError


def block_tokens(index: int, prompt_tokens: int, page_size: int) -> int:
    """Tokens of block ``index`` of a prompt (the last one may be partial)."""
    return min(page_size, prompt_tokens - index * page_size)


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
    each block's layers in order."""

    def __init__(self, num_layers: int, prompt_tokens: int, page_size: int, token_layer_bytes: int) -> None:
        """``token_layer_bytes``: one token's bytes of one layer (a block of t tokens has
        ``t * token_layer_bytes`` bytes per layer)."""
        if num_layers <= 0 or prompt_tokens <= 0 or page_size <= 0 or token_layer_bytes <= 0:
            raise BlockFormatError(f"layer-wise handoff of {num_layers} layers, {prompt_tokens} tokens, "
                                   f"{page_size}-token blocks, {token_layer_bytes} bytes per token and layer")
        self.num_layers, self.prompt_tokens, self.page_size = num_layers, prompt_tokens, page_size
        self.num_blocks = -(-prompt_tokens // page_size)
        self._layer_bytes = [block_tokens(i, prompt_tokens, page_size) * token_layer_bytes
                             for i in range(self.num_blocks)]
        self._buffers = [empty_buffer(b * num_layers) for b in self._layer_bytes]
        self._next_layer = [0] * self.num_blocks  # per block: the layer it takes next
        self.received = 0  # payload bytes taken

    def feed(self, chunk: WireChunk) -> None:
        """Take one slice; ``BlockFormatError`` when it is not the next layer of each of its blocks."""
        meta = chunk.meta
        if not isinstance(meta, decode_pb2.LayerSliceMeta) or not chunk.last:
            raise BlockFormatError("a layer slice comes in one message, with its meta")
        layer, first, count = meta.layer, meta.first_block, meta.num_blocks
        if not 0 <= layer < self.num_layers:
            raise BlockFormatError(f"layer {layer} of a {self.num_layers}-layer handoff")
        if count <= 0 or first < 0 or first + count > self.num_blocks:
            raise BlockFormatError(f"blocks [{first}, {first + count}) of a {self.num_blocks}-block prompt")
        last = first + count - 1
        if meta.last_block_tokens != block_tokens(last, self.prompt_tokens, self.page_size):
            raise BlockFormatError(f"block {last} of {meta.last_block_tokens} tokens; the prompt's has "
                                   f"{block_tokens(last, self.prompt_tokens, self.page_size)}")
        data = memoryview(chunk.data) if not isinstance(chunk.data, tuple) else memoryview(b"".join(chunk.data))
        expected = sum(self._layer_bytes[first : first + count])
        if len(data) != expected or meta.nbytes != expected:
            raise BlockFormatError(f"layer {layer} of blocks [{first}, {last + 1}): {len(data)} bytes "
                                   f"(meta says {meta.nbytes}), {expected} expected")
        for block in range(first, first + count):
            if self._next_layer[block] != layer:
                what = "again" if layer < self._next_layer[block] else f"before layer {self._next_layer[block]}"
                raise BlockFormatError(f"layer {layer} of block {block} arrived {what}")
        offset = 0
        for block in range(first, first + count):
            size = self._layer_bytes[block]
            self._buffers[block][layer * size : (layer + 1) * size] = data[offset : offset + size]
            self._next_layer[block] = layer + 1
            offset += size
        self.received += len(data)

    def payloads(self) -> list[memoryview]:
        """Every block's payload; ``BlockFormatError`` naming the first missing layer if any."""
        for block, layer in enumerate(self._next_layer):
            if layer != self.num_layers:
                raise BlockFormatError(f"layer {layer} of block {block} never arrived "
                                       f"({self.num_layers} layers, {self.num_blocks} blocks)")
        return self._buffers
