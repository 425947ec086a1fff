"""``BlockChunk`` messages encoded and decoded by hand, so payloads skip protobuf's copies.

The one codec of every stream that carries KV blocks: kvstore puts and gets, the prefill ->
decode handoff (a ``BlockChunk`` inside ``HandoffPart``, see ``handoff_wire``) and peer prefix
pulls (``FetchPrefix``).

The bytes are exactly protobuf's wire form of ``BlockChunk`` in ``common.proto``: any gRPC
client in any language reads and writes them with its generated code. Python's protobuf would
copy a payload three times on the way in or out (into the message, out to bytes, and again on
``.data``); here the header goes through protobuf and the payload is one join on sending and a
``memoryview`` slice of the received message on receiving.

Decoding never raises: a malformed message becomes a ``WireChunk`` with ``error`` set, so a
servicer answers INVALID_ARGUMENT instead of gRPC's opaque deserialisation failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from google.protobuf.message import Message

from crescent.protos import common_pb2
from crescent.services.kvwire.kv_block import DEFAULT_MAX_CHUNK_BYTES, KvBlock, meta_of

# Field numbers and wire types of BlockChunk: meta = 1 (message), data = 2 (bytes), last = 3 (bool).
_META_TAG, _DATA_TAG, _LAST_TRUE = b"\x0a", b"\x12", b"\x18\x01"
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


@dataclass(slots=True)
class WireChunk:
    meta: Message | None = None  # a BlockMeta; a LayerSliceMeta in a layer-wise handoff's LayerSlice
    data: bytes | memoryview | tuple[bytes | memoryview, ...] = b""  # a tuple: pieces joined on sending
    last: bool = False
    error: str = ""  # set by ``decode_chunk`` on a malformed message


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk(chunk: WireChunk, field: int | None = None) -> bytes:
    """The chunk's bytes; with ``field``, as that length-delimited field of an enclosing message
    (``HandoffPart.block`` is field 2), still with one join of the payload."""
    parts: list[bytes | memoryview] = []
    if chunk.meta is not None:
        header = chunk.meta.SerializeToString()
        parts += [_META_TAG, _varint(len(header)), header]
    pieces = chunk.data if isinstance(chunk.data, tuple) else (chunk.data,)
    size = sum(len(p) for p in pieces)
    if size:
        parts += [_DATA_TAG, _varint(size), *pieces]
    if chunk.last:
        parts.append(_LAST_TRUE)
    if field is not None:
        parts[:0] = [_varint(field << 3 | _LENGTH_DELIMITED), _varint(sum(len(p) for p in parts))]
    return b"".join(parts)


def message_fields(raw: bytes | memoryview) -> dict[int, memoryview]:
    """The length-delimited fields of a message, as slices of ``raw`` (the last of a repeated
    one); other fields are skipped. Raises ``ValueError`` on malformed bytes."""
    return {field: value for field, value in _fields(memoryview(raw)) if isinstance(value, memoryview)}


def _fields(view: memoryview) -> Iterator[tuple[int, int | memoryview | None]]:
    """Each field of a message in order: a varint's value, a length-delimited field's slice of
    ``view``, None for a fixed-width one. Raises ``ValueError`` on malformed bytes."""
    pos = 0
    while pos < len(view):
        tag, pos = _read_varint(view, pos)
        field, wire_type = tag >> 3, tag & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(view, pos)
            yield field, value
        elif wire_type == _LENGTH_DELIMITED:
            length, pos = _read_varint(view, pos)
            if pos + length > len(view):
                raise ValueError(f"field {field} runs {pos + length - len(view)} bytes past the message")
            yield field, view[pos : pos + length]
            pos += length
        elif wire_type in (_FIXED64, _FIXED32):
            pos += 8 if wire_type == _FIXED64 else 4
            if pos > len(view):
                raise ValueError("truncated fixed-width field")
            yield field, None
        else:
            raise ValueError(f"wire type {wire_type} of field {field} is not valid here")


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def decode_chunk(raw: bytes, meta_type: type[Message] = common_pb2.BlockMeta) -> WireChunk:
    """A ``BlockChunk`` (or a message of the same fields whose meta is ``meta_type``)."""
    chunk = WireChunk()
    try:
        for field, value in _fields(memoryview(raw)):
            if field == 3 and isinstance(value, int):
                chunk.last = bool(value)
            elif field == 1 and isinstance(value, memoryview):
                if chunk.meta is None:
                    chunk.meta = meta_type()
                chunk.meta.MergeFromString(value)  # protobuf merges a repeated message field
            elif field == 2 and isinstance(value, memoryview):
                chunk.data = value
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError among them; reported, not raised
        return WireChunk(error=f"malformed BlockChunk: {exc}")
    return chunk


def block_chunks(meta: common_pb2.BlockMeta, payload: bytes | memoryview, max_chunk_bytes: int) -> Iterator[WireChunk]:
    """One block as chunks of at most ``max_chunk_bytes`` (slices, not copies): the first
    carries ``meta``, the last has ``last`` set."""
    if max_chunk_bytes <= 0:
        raise ValueError(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
    view = memoryview(payload)
    total = len(view)
    if total == 0:
        yield WireChunk(meta=meta, last=True)
        return
    for start in range(0, total, max_chunk_bytes):
        end = min(start + max_chunk_bytes, total)
        yield WireChunk(meta=meta if start == 0 else None, data=view[start:end], last=end == total)


def chunks_of_block(block: KvBlock, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Iterator[WireChunk]:
    """The chunk stream of one block (``BlockAssembler`` reverses it)."""
    return block_chunks(meta_of(block), block.payload, max_chunk_bytes)


def miss(key: bytes) -> WireChunk:
    """The Get-reply marker for a key the store has no valid copy of."""
    return WireChunk(meta=common_pb2.BlockMeta(key=key, found=False), last=True)
