"""The hand-written BlockChunk codec (byte-for-byte protobuf) and the fused copy + CRC."""

from __future__ import annotations

import os
import zlib

import pytest

from crescent.protos import common_pb2
from crescent.services.kvwire import chunk_wire
from crescent.services.kvwire.fused_copy import ParallelCopier, copy_with_checksum, empty_buffer
from crescent.services.kvwire.kv_block import BlockAssembler, meta_of

from .helpers import make_chain


def test_encoded_chunks_are_protobufs_own_bytes() -> None:
    block = make_chain(1, floats=300)[0]
    meta = meta_of(block)
    for chunk in chunk_wire.block_chunks(meta, block.payload, 500):
        proto = common_pb2.BlockChunk(data=bytes(chunk.data), last=chunk.last)
        if chunk.meta is not None:
            proto.meta.CopyFrom(chunk.meta)
        assert chunk_wire.encode_chunk(chunk) == proto.SerializeToString()
    miss = chunk_wire.miss(b"k" * 16)
    assert common_pb2.BlockChunk.FromString(chunk_wire.encode_chunk(miss)).meta.found is False


def test_decoding_protobuf_bytes_gives_the_same_chunk_without_copying_data() -> None:
    block = make_chain(1, floats=64)[0]
    proto = common_pb2.BlockChunk(meta=meta_of(block), data=bytes(block.payload), last=True)
    raw = proto.SerializeToString()
    chunk = chunk_wire.decode_chunk(raw)
    assert not chunk.error and chunk.last and chunk.meta == proto.meta
    assert bytes(chunk.data) == bytes(block.payload)
    assert isinstance(chunk.data, memoryview) and chunk.data.obj is raw  # a view of the message


def test_unknown_fields_are_skipped_as_protobuf_would() -> None:
    extra = b"\x20\x07" + b"\x29" + b"\0" * 8 + b"\x35" + b"\0" * 4 + b"\x3a\x02hi"  # fields 4-7
    raw = common_pb2.BlockChunk(data=b"abc", last=True).SerializeToString() + extra
    chunk = chunk_wire.decode_chunk(raw)
    assert not chunk.error and bytes(chunk.data) == b"abc" and chunk.last


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\x12\x50abc", "runs 77 bytes past"),
        (b"\x0a\x03\xff\xff\xff", "BlockMeta"),
        (b"\x1b", "wire type 3"),
        (b"\x18" + b"\xff" * 11, "varint"),
    ],
)
def test_malformed_chunks_are_reported_not_raised(raw: bytes, message: str) -> None:
    chunk = chunk_wire.decode_chunk(raw)
    assert message in chunk.error and chunk.meta is None


@pytest.mark.parametrize("chunk_bytes", [1 << 10, 3000, 1 << 20])
def test_wire_chunks_reassemble_into_the_block(chunk_bytes: int) -> None:
    block = make_chain(1, floats=2500)[0]
    assembler = BlockAssembler()
    got = None
    for chunk in chunk_wire.block_chunks(meta_of(block), block.payload, chunk_bytes):
        got = assembler.feed(chunk_wire.decode_chunk(chunk_wire.encode_chunk(chunk))) or got
    assert got is not None and bytes(got.payload) == bytes(block.payload)
    got.verify(block.model_id)


def test_assembling_into_a_given_buffer_checks_the_crc_on_the_way() -> None:
    block = make_chain(1, floats=4096)[0]
    target = empty_buffer(block.nbytes)
    assembler = BlockAssembler()
    chunks = list(chunk_wire.block_chunks(meta_of(block), block.payload, 5000))
    got = None
    for i, chunk in enumerate(chunks):
        got = assembler.feed(chunk, into=target if i == 0 else None) or got
    assert got is not None and got.payload_crc == block.checksum
    assert bytes(target) == bytes(block.payload)
    corrupt = bytearray(block.payload)
    corrupt[100] ^= 1
    assembler = BlockAssembler()
    for chunk in chunk_wire.block_chunks(meta_of(block), bytes(corrupt), 5000):
        bad = assembler.feed(chunk)
    with pytest.raises(ValueError, match="checksum"):
        bad.verify(None)


@pytest.mark.parametrize("size", [0, 1, 100_000, (1 << 20) + 7])
def test_copy_with_checksum_copies_and_matches_zlib(size: int) -> None:
    data = os.urandom(size)
    target = empty_buffer(size)
    assert copy_with_checksum(target, data) == zlib.crc32(data)
    assert bytes(target) == data
    half = size // 2  # continuing from the CRC of what came before
    assert copy_with_checksum(target[half:], data[half:], zlib.crc32(data[:half])) == zlib.crc32(data)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parallel_copies_split_payloads_across_threads_correctly(threads: int) -> None:
    sizes = [0, 5 << 20, 1, 3 << 20, 777, 2 << 20, 0]  # payloads split at arbitrary points
    sources = [os.urandom(n) for n in sizes]
    targets = [empty_buffer(n) for n in sizes]
    copier = ParallelCopier(threads)
    try:
        crcs = copier.copy(list(zip(targets, sources)))
    finally:
        copier.close()
    assert crcs == [zlib.crc32(s) for s in sources]
    assert [bytes(t) for t in targets] == sources
    with pytest.raises(ValueError, match="into"):
        ParallelCopier(1).copy([(empty_buffer(3), b"four")])


@pytest.mark.parametrize("threads", [1, 2])
def test_plain_parallel_copies_copy_everything(threads: int) -> None:
    sizes = [3 << 20, 0, 5 << 20 | 3, 0]
    sources = [os.urandom(n) for n in sizes]
    targets = [empty_buffer(n) for n in sizes]
    copier = ParallelCopier(threads)
    try:
        assert copier.copy(list(zip(targets, sources)), checksum=False) == [0] * len(sizes)
    finally:
        copier.close()
    assert [bytes(t) for t in targets] == sources
