"""One KV block in memory, its integrity check, and its assembly from a ``BlockChunk`` stream
(whose codec is ``chunk_wire``).

A ``KvBlock`` is the unit prefill writes and reads back: ``B`` tokens' KV for all layers (plus
the recurrent state of linear-attention layers for hybrid models), as the raw little-endian bytes
of a C-contiguous tensor of ``shape`` and ``dtype``. Every copy read back from anywhere is checked
with ``verify`` before use: the cache is only a cache, so a bad block must become a miss.

Payloads are several MB, so the code here avoids copies: chunks slice a ``memoryview`` and the
assembler writes pieces into one preallocated buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from crescent.protos import common_pb2
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.fused_copy import copy_with_checksum, crc32, empty_buffer

# Bump when the payload layout of a block changes; older blocks then read as misses.
KV_FORMAT_VERSION = 1

# gRPC messages stay well below the 80 MiB limit and the default 4 MiB of other clients.
DEFAULT_MAX_CHUNK_BYTES = 4 * 1024 * 1024

DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
}


class BlockIntegrityError(ValueError):
    """A block whose bytes or header cannot be trusted (checksum, model, version, size)."""


class BlockFormatError(ValueError):
    """A chunk stream that does not describe whole blocks (missing header, wrong length)."""


def payload_checksum(payload: bytes | memoryview) -> int:
    """CRC32 (zlib's polynomial) of a payload."""
    return crc32(payload)


def expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a C-contiguous tensor; raises ``BlockIntegrityError`` on an unknown dtype."""
    size = DTYPE_SIZES.get(dtype)
    if size is None:
        raise BlockIntegrityError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_SIZES))}")
    if any(d < 0 for d in shape):
        raise BlockIntegrityError(f"negative dimension in shape {shape}")
    return size * math.prod(shape)


@dataclass(frozen=True, slots=True)
class KvBlock:
    key: BlockKey
    parent_key: BlockKey | None
    model_id: str
    dtype: str
    shape: tuple[int, ...]
    token_ids: tuple[int, ...]
    payload: bytes | memoryview
    checksum: int
    format_version: int = KV_FORMAT_VERSION
    # The payload's CRC32 when whoever filled the payload computed it on the way (a fused
    # copy), so ``verify`` needs no second pass; None: ``verify`` computes it.
    payload_crc: int | None = None

    @classmethod
    def build(
        cls,
        key: BlockKey,
        parent_key: BlockKey | None,
        model_id: str,
        dtype: str,
        shape: tuple[int, ...] | list[int],
        token_ids: tuple[int, ...] | list[int],
        payload: bytes | bytearray | memoryview,
    ) -> KvBlock:
        """A new block with its checksum computed. ``payload`` is kept, not copied
        (a bytearray is wrapped in a read-only memoryview); do not mutate it afterwards."""
        if isinstance(payload, bytearray):
            payload = memoryview(payload).toreadonly()
        elif isinstance(payload, memoryview):
            payload = payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload
        return cls(
            key=key,
            parent_key=parent_key or None,
            model_id=model_id,
            dtype=dtype,
            shape=tuple(int(d) for d in shape),
            token_ids=tuple(int(t) for t in token_ids),
            payload=payload,
            checksum=payload_checksum(payload),
        )

    @classmethod
    def from_meta(cls, meta: common_pb2.BlockMeta, payload: bytes | memoryview, payload_crc: int | None = None) -> KvBlock:
        """A block as received: the checksum is the sender's; call ``verify`` before use.
        ``payload_crc``: the CRC of ``payload`` if the receiver computed it while copying."""
        return cls(
            key=BlockKey(bytes(meta.key)),
            parent_key=BlockKey(bytes(meta.parent_key)) if meta.parent_key else None,
            model_id=meta.model_id,
            dtype=meta.dtype,
            shape=tuple(meta.shape),
            token_ids=tuple(meta.token_ids),
            payload=payload,
            checksum=meta.checksum,
            format_version=meta.format_version,
            payload_crc=payload_crc,
        )

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def verify(self, expected_model_id: str | None = None) -> None:
        """Raise ``BlockIntegrityError`` unless this block is safe to use.

        ``expected_model_id`` None skips the model check (a store holding blocks of many models).
        """
        if self.format_version != KV_FORMAT_VERSION:
            raise BlockIntegrityError(
                f"block {self.key.hex()}: format version {self.format_version}, expected {KV_FORMAT_VERSION}"
            )
        if expected_model_id is not None and self.model_id != expected_model_id:
            raise BlockIntegrityError(
                f"block {self.key.hex()}: model {self.model_id!r}, expected {expected_model_id!r}"
            )
        want = expected_nbytes(self.dtype, self.shape)
        if self.nbytes != want:
            raise BlockIntegrityError(
                f"block {self.key.hex()}: {self.nbytes} payload bytes, shape {self.shape} {self.dtype} needs {want}"
            )
        actual = payload_checksum(self.payload) if self.payload_crc is None else self.payload_crc
        if actual != self.checksum:
            raise BlockIntegrityError(
                f"block {self.key.hex()}: checksum {actual:#010x}, header says {self.checksum:#010x}"
            )

    def to_meta(self) -> common_pb2.BlockMeta:
        return meta_of(self)


def meta_of(block: KvBlock, *, found: bool = True) -> common_pb2.BlockMeta:
    return common_pb2.BlockMeta(
        key=block.key,
        parent_key=block.parent_key or b"",
        model_id=block.model_id,
        format_version=block.format_version,
        dtype=block.dtype,
        shape=block.shape,
        token_ids=block.token_ids,
        nbytes=block.nbytes,
        checksum=block.checksum,
        found=found,
    )


class Chunk(Protocol):
    """What ``BlockAssembler`` reads: ``chunk_wire.WireChunk`` (meta None when absent)."""

    meta: common_pb2.BlockMeta | None
    data: bytes | memoryview
    last: bool


class BlockAssembler:
    """Rebuilds blocks from a chunk stream, one block at a time.

    ``feed`` returns the finished block on its last chunk and None before. In a Get reply
    stream (``replies=True``) a header with ``found`` false is a miss: ``feed`` returns None and
    sets ``last_miss`` to its key.
    A block that arrives in one chunk keeps that chunk's bytes (no copy); one in pieces is copied
    into one buffer, checksummed on the way so ``verify`` costs no second pass.
    Raises ``BlockFormatError`` on a malformed stream; the assembler is then reset.
    """

    def __init__(self, *, replies: bool = False, max_block_bytes: int = 1 << 31) -> None:
        self._replies = replies  # True: a Get reply stream, where found=false marks a miss
        self._max_block_bytes = max_block_bytes
        self.reset()
        self.last_miss: bytes | None = None

    @property
    def in_progress(self) -> bool:
        return self._meta is not None

    def reset(self) -> None:
        self._meta: common_pb2.BlockMeta | None = None
        self._buffer: memoryview | None = None
        self._single: bytes | memoryview | None = None
        self._filled = 0
        self._crc = 0

    def _fail(self, message: str) -> BlockFormatError:
        self.reset()
        return BlockFormatError(message)

    def feed(self, chunk: Chunk, into: memoryview | None = None) -> KvBlock | None:
        """``into``: where to put the block this chunk starts (``meta.nbytes`` long, e.g. room
        reserved in a host pool); by default a buffer of its own, or the chunk's own bytes."""
        self.last_miss = None
        meta, data, last = chunk.meta, chunk.data, chunk.last
        if meta is not None:
            if self._meta is not None:
                raise self._fail(f"block {self._meta.key.hex()} ended without its last chunk")
            if self._replies and not meta.found:
                # A Get reply's miss marker: a header alone with found=false.
                if len(data) or not last:
                    raise self._fail(f"miss marker for {meta.key.hex()} carries data")
                self.last_miss = bytes(meta.key)
                return None
            if not meta.key:
                raise self._fail("block header without a key")
            if meta.nbytes > self._max_block_bytes:
                raise self._fail(f"block {meta.key.hex()} of {meta.nbytes} bytes exceeds {self._max_block_bytes}")
            if into is not None and len(into) != meta.nbytes:
                raise ValueError(f"a buffer of {len(into)} bytes for a block of {meta.nbytes}")
            self._meta, self._buffer = meta, into
        elif self._meta is None:
            raise self._fail("chunk without a block header")
        meta = self._meta
        if self._filled + len(data) > meta.nbytes:
            raise self._fail(f"block {meta.key.hex()}: more than the {meta.nbytes} bytes announced")
        if self._filled == 0 and last and self._buffer is None:
            self._single = data  # the common case: the whole block in one message, no copy
        else:
            if self._buffer is None:
                self._buffer = empty_buffer(meta.nbytes)
            end = self._filled + len(data)
            self._crc = copy_with_checksum(self._buffer[self._filled : end], data, self._crc)
        self._filled += len(data)
        if not last:
            return None
        if self._filled != meta.nbytes:
            raise self._fail(f"block {meta.key.hex()}: {self._filled} bytes received, {meta.nbytes} announced")
        if self._single is not None:
            block = KvBlock.from_meta(meta, self._single)
        else:
            assert self._buffer is not None
            block = KvBlock.from_meta(meta, self._buffer.toreadonly(), payload_crc=self._crc)
        self.reset()
        return block
