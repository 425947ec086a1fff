"""The byte form of a block at rest (disk files, S3 objects): a small framed header, then the
raw payload. ``MAGIC | u32 header length | BlockMeta (protobuf) | payload``; no pickle."""

from __future__ import annotations

import struct
from typing import BinaryIO

from crescent.protos import common_pb2
from crescent.services.kvwire.kv_block import BlockFormatError, KvBlock, meta_of

MAGIC = b"CKVB"
_PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 1 << 20


def header_bytes(block: KvBlock) -> bytes:
    """Everything before the payload; write it, then the payload, to get the whole object."""
    meta = meta_of(block).SerializeToString()
    return _PREFIX.pack(MAGIC, len(meta)) + meta


def encode(block: KvBlock) -> bytes:
    """One contiguous object (S3 bodies need one); copies the payload once."""
    return header_bytes(block) + bytes(block.payload)


def _parse_prefix(prefix: bytes) -> int:
    if len(prefix) < _PREFIX.size:
        raise BlockFormatError("truncated block header")
    magic, length = _PREFIX.unpack_from(prefix)
    if magic != MAGIC or length > MAX_HEADER_BYTES:
        raise BlockFormatError("not a Crescent KV block")
    return length


def _parse_meta(data: bytes | memoryview) -> common_pb2.BlockMeta:
    meta = common_pb2.BlockMeta()
    try:
        meta.ParseFromString(bytes(data))
    except Exception as exc:  # protobuf raises its own DecodeError
        raise BlockFormatError(f"unreadable block header: {exc}") from None
    return meta


def decode(data: bytes) -> KvBlock:
    """A block from its stored bytes, unverified (the payload is a view, not a copy)."""
    length = _parse_prefix(data[: _PREFIX.size])
    start = _PREFIX.size + length
    if len(data) < start:
        raise BlockFormatError("truncated block header")
    meta = _parse_meta(memoryview(data)[_PREFIX.size : start])
    return KvBlock.from_meta(meta, memoryview(data)[start:].toreadonly())


def read_meta(f: BinaryIO) -> common_pb2.BlockMeta:
    """Only the header of a stored block (re-indexing reads nothing else)."""
    length = _parse_prefix(f.read(_PREFIX.size))
    raw = f.read(length)
    if len(raw) != length:
        raise BlockFormatError("truncated block header")
    return _parse_meta(raw)
