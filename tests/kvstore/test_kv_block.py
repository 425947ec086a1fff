"""KvBlock: checksums, verification, and the chunk stream round trip."""

from __future__ import annotations

import os

import pytest

from crescent.services.contract.block_keys import prefix_block_keys
from crescent.services.kvwire.kv_block import (
    KV_FORMAT_VERSION,
    BlockAssembler,
    BlockFormatError,
    BlockIntegrityError,
    KvBlock,
)
from crescent.services.kvwire.chunk_wire import WireChunk, chunks_of_block, decode_chunk, encode_chunk, miss


def block_to_chunks(block: KvBlock, max_chunk_bytes: int) -> list[WireChunk]:
    """The block's chunks as a receiver decodes them off the wire."""
    return [decode_chunk(encode_chunk(c)) for c in chunks_of_block(block, max_chunk_bytes)]

MODEL = "test-model"


def make_block(n_floats: int = 1024, parent: bytes | None = None, seed: int = 0) -> KvBlock:
    tokens = list(range(seed, seed + 4))
    key = prefix_block_keys(tokens, 4, MODEL)[0]
    return KvBlock.build(key, parent, MODEL, "float32", (n_floats,), tokens, os.urandom(4 * n_floats))


def test_build_computes_a_checksum_that_verify_accepts() -> None:
    block = make_block()
    block.verify(MODEL)
    assert block.nbytes == 4096 and block.format_version == KV_FORMAT_VERSION
    assert block.to_meta().nbytes == 4096 and block.to_meta().checksum == block.checksum


@pytest.mark.parametrize(
    "change, message",
    [
        ({"payload": b"\x00" * 4096}, "checksum"),
        ({"model_id": "other"}, "model"),
        ({"format_version": KV_FORMAT_VERSION + 1}, "format version"),
        ({"shape": (1023,)}, "needs"),
        ({"dtype": "complex7"}, "unknown dtype"),
    ],
)
def test_verify_rejects_each_kind_of_bad_block(change: dict, message: str) -> None:
    import dataclasses

    bad = dataclasses.replace(make_block(), **change)
    with pytest.raises(BlockIntegrityError, match=message):
        bad.verify(MODEL)


@pytest.mark.parametrize("n_floats, chunk", [(0, 64), (10, 64), (16, 64), (1000, 64), (1 << 20, 1 << 20)])
def test_chunks_round_trip_through_the_assembler(n_floats: int, chunk: int) -> None:
    block = make_block(n_floats, parent=b"p" * 16)
    chunks = list(block_to_chunks(block, max_chunk_bytes=chunk))
    assert chunks[0].meta is not None and chunks[-1].last
    assert all(len(c.data) <= chunk for c in chunks)
    assembler = BlockAssembler()
    outputs = [assembler.feed(c) for c in chunks]
    assert all(o is None for o in outputs[:-1])
    got = outputs[-1]
    assert got is not None
    got.verify(MODEL)
    assert bytes(got.payload) == bytes(block.payload) and got.parent_key == block.parent_key
    assert got.token_ids == block.token_ids and got.shape == block.shape


def test_assembler_reads_consecutive_blocks_and_misses() -> None:
    a, b = make_block(100, seed=1), make_block(300, seed=2)
    assembler = BlockAssembler(replies=True)
    stream = [*block_to_chunks(a, 128), miss(b"k" * 16), *block_to_chunks(b, 128)]
    blocks, misses = [], []
    for chunk in stream:
        got = assembler.feed(chunk)
        if got is not None:
            blocks.append(got)
        if assembler.last_miss is not None:
            misses.append(assembler.last_miss)
    assert [x.key for x in blocks] == [a.key, b.key] and misses == [b"k" * 16]


def test_assembler_rejects_malformed_streams() -> None:
    block = make_block(100)
    chunks = list(block_to_chunks(block, 128))
    with pytest.raises(BlockFormatError, match="without a block header"):
        BlockAssembler().feed(chunks[1])
    assembler = BlockAssembler()
    assembler.feed(chunks[0])
    with pytest.raises(BlockFormatError, match="without its last chunk"):
        assembler.feed(chunks[0])
    too_long = WireChunk(meta=block.to_meta(), data=bytes(block.payload) + b"x", last=True)
    with pytest.raises(BlockFormatError, match="more than"):
        BlockAssembler().feed(too_long)
    short = WireChunk(meta=block.to_meta(), data=bytes(block.payload)[:-4], last=True)
    with pytest.raises(BlockFormatError, match="announced"):
        BlockAssembler().feed(short)


def test_checksum_is_zlib_crc32() -> None:
    import zlib

    from crescent.services.kvwire.kv_block import payload_checksum

    data = os.urandom(100_003)
    assert payload_checksum(data) == zlib.crc32(data)
    assert payload_checksum(memoryview(data)[7:]) == zlib.crc32(data[7:])
