"""The prefill -> decode handoff stream (``HandoffPart``) through ``chunk_wire``'s codec.

A ``HandoffPart`` is the request's header, one ``BlockChunk`` of its KV (field 2), or, in a
layer-wise handoff (``layer_wire``), one ``LayerSlice`` (field 3, BlockChunk's field numbers)
or the ``HandoffTail`` (field 4), and for a hybrid model the last block's recurrent state
(field 5, a ``BlockChunk`` piece). Headers and tails are small and go through protobuf; a block
chunk or layer slice is written by ``chunk_wire`` as that field, so the payload is joined once on sending and sliced, not copied, on receiving — the
same codec as kvstore puts and gets. The bytes are exactly protobuf's, so a client or server
built from the generated code interoperates.

Decoding never raises: a malformed message becomes a part with ``error`` set, which the decode
servicer answers with INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from crescent.protos import common_pb2, decode_pb2
from crescent.services.kvwire import chunk_wire
from crescent.services.kvwire.kv_block import DEFAULT_MAX_CHUNK_BYTES

_HEADER_FIELD, _BLOCK_FIELD, _LAYER_FIELD, _TAIL_FIELD, _STATE_FIELD = 1, 2, 3, 4, 5  # HandoffPart's oneof in decode.proto


@dataclass(slots=True)
class HandoffWirePart:
    header: decode_pb2.HandoffHeader | None = None
    block: chunk_wire.WireChunk | None = None
    layer: chunk_wire.WireChunk | None = None  # a LayerSlice: its meta a LayerSliceMeta
    tail: decode_pb2.HandoffTail | None = None
    state: chunk_wire.WireChunk | None = None  # a piece of the last block's recurrent state (layer-wise, kimi_k3)
    error: str = ""  # set by ``decode_part`` on a malformed message


def encode_part(part: HandoffWirePart) -> bytes:
    if part.header is not None:
        return decode_pb2.HandoffPart(header=part.header).SerializeToString()
    if part.tail is not None:
        return decode_pb2.HandoffPart(tail=part.tail).SerializeToString()
    if part.layer is not None:
        return chunk_wire.encode_chunk(part.layer, field=_LAYER_FIELD)
    if part.state is not None:
        return chunk_wire.encode_chunk(part.state, field=_STATE_FIELD)
    assert part.block is not None, "a handoff part is a header, a block chunk, a layer slice, a tail or a state"
    return chunk_wire.encode_chunk(part.block, field=_BLOCK_FIELD)


def decode_part(raw: bytes) -> HandoffWirePart:
    try:
        fields = chunk_wire.message_fields(raw)
        if _HEADER_FIELD in fields:
            return HandoffWirePart(header=decode_pb2.HandoffHeader.FromString(fields[_HEADER_FIELD]))
        if _TAIL_FIELD in fields:
            return HandoffWirePart(tail=decode_pb2.HandoffTail.FromString(fields[_TAIL_FIELD]))
        if _LAYER_FIELD in fields:
            layer = chunk_wire.decode_chunk(fields[_LAYER_FIELD], decode_pb2.LayerSliceMeta)
            return HandoffWirePart(layer=layer, error=layer.error)
        if _STATE_FIELD in fields:
            state = chunk_wire.decode_chunk(fields[_STATE_FIELD])
            return HandoffWirePart(state=state, error=state.error)
        if _BLOCK_FIELD not in fields:
            return HandoffWirePart(error="malformed HandoffPart: neither a header, a block, a layer slice, a tail nor a state")
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError among them; reported, not raised
        return HandoffWirePart(error=f"malformed HandoffPart: {exc}")
    chunk = chunk_wire.decode_chunk(fields[_BLOCK_FIELD])
    return HandoffWirePart(block=chunk, error=chunk.error)


def handoff_parts(header: decode_pb2.HandoffHeader,
                  blocks: Sequence[tuple[common_pb2.BlockMeta, bytes | memoryview]],
                  max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Iterator[HandoffWirePart]:
    """The whole stream: the header, then each (meta, payload) as chunks (slices, not copies)."""
    yield HandoffWirePart(header=header)
    for meta, payload in blocks:
        for chunk in chunk_wire.block_chunks(meta, payload, max_chunk_bytes):
            yield HandoffWirePart(block=chunk)
