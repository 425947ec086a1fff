"""The layer-wise handoff through shared memory, prefill and decode on one host.

What a user would notice: a prompt handed from a real prefill process to a real decode process
through a /dev/shm segment decodes the same tokens as one process, and the metrics say shared
memory carried it; a decode instance that will not map the segment still gets the request (over
gRPC bytes, from then on without asking again); a segment whose bytes do not match a note's
CRC, or a note outside the prompt, is refused (INVALID_ARGUMENT) and nothing is admitted; no
segment is left in /dev/shm.
"""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
import torch

from crescent.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from crescent.services.kvwire.fused_copy import crc32
from crescent.services.kvwire.handoff_shm import (NAME_PREFIX, HandoffSegment, MappedLayerAssembler, instance_tag,
                                                  layer_note, sweep)
from crescent.services.kvwire.handoff_wire import HandoffWirePart, decode_part, encode_part
from crescent.services.kvwire.kv_block import BlockFormatError
from crescent.services.kvwire.layer_wire import LayerAssembler, LayerLayout, block_buffers, block_tokens, buffers_nbytes
from crescent.services.kvwire.shm_files import SHM_DIR, available
from crescent.services.prefill.handoff_mover import HandoffMovers
from crescent.services.prefill.layerwise import LayerwiseHandoff
from crescent.services.prefill.prompt_export import PromptExport
from tests.decode.process import BLOCK, TEXTS, DecodeProcess, PromptKv, SchedulerStandIn, decode_stub, stream_all
from tests.dataplane.families import LLAMA_PAGE as PAGE, llama_engine as make_engine, prompt_bytes

pytestmark = pytest.mark.skipif(not available(), reason="no writable /dev/shm")

HANDOFFS, BYTES = "crescent_handoff_total", "crescent_handoff_bytes_total"


def segments_of(*pids: int) -> list[str]:
    """Handoff segments in /dev/shm made by these processes."""
    return [p.name for p in SHM_DIR.glob(f"{NAME_PREFIX}*") if int(p.name.split("-")[3]) in pids]


# ---- in one process: the notes, the mapped assembler, the fallback's resend ------------------------

def stream_over(engine, tokens: list[int], refuse_after: int | None, seq_id: str = "s"):
    """Prefill ``tokens`` while a ``LayerwiseHandoff`` streams them over shared memory to a
    stand-in decode that maps the segment, or (``refuse_after`` parts in) refuses it as a decode
    on another host would; (the streams' decoded parts, the handoff, the sequence)."""
    async def main():
        seq = engine.add_sequence(seq_id, tokens)
        export = PromptExport(engine, None, seq, len(tokens))
        movers = HandoffMovers(f"test-{os.getpid()}", shared_memory=True)
        streamed = LayerwiseHandoff(engine, seq, export, decode_pb2.HandoffHeader(request_id=seq_id, prompt_token_ids=tokens),
                                    movers, "peer:1")
        streams: list[list] = []

        async def call(parts):
            streams.append([])
            async for part in parts:
                part = decode_part(encode_part(part))
                streams[-1].append(part)
                if refuse_after is not None and len(streams) == 1 and len(streams[-1]) > refuse_after:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, None, None,
                                               details="shm handoff: cannot open it here")
            return decode_pb2.HandoffReply(accepted=True)

        assert streamed.segment is not None
        streamed.start(call)
        await asyncio.to_thread(engine.prefill, seq, streamed.on_layer)
        await streamed.finish([7], [])
        await streamed.close()
        return streams, streamed, seq
    return asyncio.run(main())


def test_decode_reads_the_cache_s_bytes_from_the_segment_and_the_notes_carry_none() -> None:
    engine = make_engine(chunk=8)
    tokens = [(5 * i + 3) % 97 for i in range(23)]
    streams, streamed, seq = stream_over(engine, tokens, refuse_after=None)
    assert len(streams) == 1 and streamed.mover == "shm"
    header, *notes, tail = streams[0]
    assert header.header.shm_segment == streamed.segment.name and tail.tail.first_token_id == 7
    assert all(len(p.layer.data) == 0 and p.layer.meta.nbytes > 0 for p in notes)
    layout = engine.cache.layer_layout()
    mapped = MappedLayerAssembler(layout, len(tokens), PAGE, streamed.segment)  # decode's view of the same memory
    for part in notes:
        mapped.feed(part.layer)
    assert [bytes(b) for b in mapped.payloads()] == prompt_bytes(engine, seq, len(tokens))
    assert not (SHM_DIR / streamed.segment.name).exists()  # unlinked once the handoff ended


def test_a_refused_segment_is_sent_again_as_bytes_with_every_slice_once() -> None:
    engine = make_engine(chunk=8)
    tokens = [(7 * i + 1) % 97 for i in range(23)]
    streams, streamed, seq = stream_over(engine, tokens, refuse_after=3)
    assert len(streams) == 2 and streamed.mover == "grpc"
    header, *slices, tail = streams[1]
    assert not header.header.shm_segment and tail.tail.first_token_id == 7
    layers = LayerAssembler(engine.cache.layer_layout(), len(tokens), PAGE)
    for part in slices:
        layers.feed(part.layer)  # raises on a layer missing, repeated or out of order
    assert [bytes(b) for b in layers.payloads()] == prompt_bytes(engine, seq, len(tokens))
    assert not (SHM_DIR / streamed.segment.name).exists()


def test_a_bad_crc_or_a_note_outside_the_prompt_is_an_error() -> None:
    layout = LayerLayout.layer_major(2, 8)
    sizes = [layout.layer_bytes(block_tokens(i, 10, 4)) for i in range(3)]
    segment = HandoffSegment.create(instance_tag("test"), buffers_nbytes(layout, sizes))
    try:
        _, buffers = block_buffers(layout, sizes, segment.buf)
        for i, buffer in enumerate(buffers):
            buffer[:] = bytes([i + 1]) * len(buffer)
        mapped = MappedLayerAssembler(layout, 10, 4, segment)
        good = crc32(buffers[0][: sizes[0]])
        with pytest.raises(BlockFormatError, match="CRC32"):
            mapped.feed(layer_note(0, 0, 1, 4, sizes[0], good ^ 1))
        with pytest.raises(BlockFormatError, match="blocks"):
            mapped.feed(layer_note(0, 2, 2, 2, sizes[2] * 2, 0))
        mapped.feed(layer_note(0, 0, 1, 4, sizes[0], good))
        with pytest.raises(BlockFormatError, match="never arrived"):
            mapped.payloads()
    finally:
        segment.unlink()


def test_a_crashed_prefill_s_segments_are_swept_and_a_live_one_s_kept() -> None:
    tag = instance_tag(f"sweep-{os.getpid()}")
    live = HandoffSegment.create(tag, 64)
    dead = SHM_DIR / f"{NAME_PREFIX}{tag}-{2**22 + 7}-{'ab' * 12}"  # a pid above pid_max: gone
    dead.write_bytes(b"x")
    try:
        assert sweep(tag) == 1
        assert not dead.exists() and (SHM_DIR / live.name).exists()
    finally:
        live.unlink()
        dead.unlink(missing_ok=True)


# ---- real processes on loopback -----------------------------------------------------------------

@pytest.mark.slow
def test_a_prompt_handed_through_shared_memory_decodes_as_one_process(tmp_path) -> None:
    prompts = PromptKv()
    scheduler = SchedulerStandIn()
    dirs = [tmp_path / name for name in ("decode", "refusing", "prefill")]
    for d in dirs:
        d.mkdir()
    decode = DecodeProcess(dirs[0], scheduler.address, 8 * BLOCK)
    refusing = DecodeProcess(dirs[1], scheduler.address, 8 * BLOCK, extra={"shm_handoff": False})  # "another host"
    prefill = DecodeProcess(dirs[2], scheduler.address, 8 * BLOCK, role="prefill",
                            extra={"layerwise_handoff": True, "tcp_handoff": False,  # shm or gRPC only (tcp: test_handoff_tcp.py)
                                   "engine": {"kv_capacity_tokens": 8 * BLOCK,
                                   "block_size": BLOCK, "threads": 1, "prefill_chunk_tokens": 96}})
    try:
        for process in (decode, refusing, prefill):
            process.start()
        per_token = prompts.engine.cache.token_layer_bytes() * prompts.engine.config.num_layers  # KV bytes
        sent = hand_off_each(prompts, prefill, [("shm", decode, TEXTS[0]), ("refused", refusing, TEXTS[1]),
                                                ("again", refusing, TEXTS[2])])
        lengths = {name: len(tokens) for name, tokens in sent.items()}
        assert prefill.metric(HANDOFFS, peer=decode.address, mover="shm") == 1
        assert prefill.metric(BYTES, peer=decode.address, mover="shm") == lengths["shm"] * per_token
        assert prefill.metric(HANDOFFS, peer=decode.address, mover="grpc") == 0
        # the refusing decode: asked once, then gRPC with it from the start
        assert prefill.metric(HANDOFFS, peer=refusing.address, mover="grpc") == 2
        assert prefill.metric(BYTES, peer=refusing.address, mover="grpc") == (lengths["refused"] + lengths["again"]) * per_token
        assert prefill.metric("crescent_handoff_shm_refused_total", peer=refusing.address) == 1
        assert prefill.metric(HANDOFFS, peer=refusing.address, mover="shm") == 0
        refused_bad_segments(decode.address, prompts, sent["again"])
        assert segments_of(prefill.proc.pid, decode.proc.pid, os.getpid()) == []
    finally:
        for process in (prefill, refusing, decode):
            process.stop()
        scheduler.stop()


def hand_off_each(prompts: PromptKv, prefill: DecodeProcess,
                  runs: list[tuple[str, DecodeProcess, str]]) -> dict[str, list[int]]:
    """Each run ``(request id, decode, text)``: a prompt of the text prefilled by ``prefill`` and
    handed to that decode, whose tokens must be a one-process run's; the prompts by id."""
    sent: dict[str, list[int]] = {}
    for name, target, text in runs:
        sent[name] = tokens = prompts.prompt(text * 12)[: 3 * BLOCK + 17]
        expected = prompts.reference(tokens, 8)
        with grpc.insecure_channel(prefill.address) as channel:
            events = list(prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id=name, token_ids=tokens, decode_address=target.address,
                sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True)), timeout=120))
        assert [e.WhichOneof("event") for e in events] == ["first_token", "handed_off"]
        channel, stub = decode_stub(target.address)
        with channel:
            rest, reason = stream_all(stub, name)
        assert [events[0].first_token.token_id, *rest] == expected and reason == "length", name
    return sent


def refused_bad_segments(address: str, prompts: PromptKv, tokens: list[int]) -> None:
    """A real decode process maps a hand-made segment; a note whose CRC does not match its bytes,
    or one outside the prompt, is INVALID_ARGUMENT and admits nothing."""
    engine = prompts.engine
    layout = engine.cache.layer_layout()
    sizes = [layout.layer_bytes(block_tokens(i, len(tokens), BLOCK)) for i in range(-(-len(tokens) // BLOCK))]

    def parts(request_id: str, segment: HandoffSegment, notes):
        yield HandoffWirePart(header=decode_pb2.HandoffHeader(
            request_id=request_id, model_id=engine.model_id, prompt_token_ids=tokens, num_layers=layout.num_layers,
            sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True), kv_dtype="float32",
            kv_block_shape=list(engine.cache.block_shape), num_blocks=len(sizes),
            shm_segment=segment.name, shm_identity=segment.identity))
        for note in notes:
            yield HandoffWirePart(layer=note)
        yield HandoffWirePart(tail=decode_pb2.HandoffTail(first_token_id=1))

    with grpc.insecure_channel(address) as channel:
        call = channel.stream_unary("/crescent.v1.Decode/Handoff", request_serializer=encode_part,
                                    response_deserializer=decode_pb2.HandoffReply.FromString)
        for name, says in [("corrupt", "CRC32"), ("outside", "blocks [")]:
            segment = HandoffSegment.create(instance_tag("test"), buffers_nbytes(layout, sizes))
            try:
                _, buffers = block_buffers(layout, sizes, segment.buf)
                torch.frombuffer(segment.buf, dtype=torch.uint8).random_(0, 255)
                crc = crc32(buffers[0][: sizes[0]])
                notes = [layer_note(0, 0, 1, BLOCK, sizes[0], crc if name != "corrupt" else crc ^ 0x5A)]
                if name == "outside":
                    notes.append(layer_note(0, len(sizes), 1, BLOCK, sizes[0], 0))
                with pytest.raises(grpc.RpcError) as caught:
                    call(parts(name, segment, notes), timeout=30)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in caught.value.details()
                with pytest.raises(grpc.RpcError) as gone:  # nothing was accepted
                    list(decode_pb2_grpc.DecodeStub(channel).StreamTokens(decode_pb2.StreamRequest(request_id=name), timeout=10))
                assert gone.value.code() == grpc.StatusCode.NOT_FOUND
                assert not (SHM_DIR / segment.name).exists()  # decode unlinked it once mapped
            finally:
                segment.unlink()


def test_a_peer_that_never_took_shared_memory_may_not_understand_it_one_that_did_must() -> None:
    def error(code, details=""):
        return grpc.aio.AioRpcError(code, None, None, details=details)

    movers = HandoffMovers(f"test-{os.getpid()}", shared_memory=True)
    # a decode built before this mover: the data-less slices are malformed to it
    assert movers.refused("old:1", error(grpc.StatusCode.INVALID_ARGUMENT, "malformed handoff: 0 bytes"))
    assert movers.segment("old:1", 64) is None  # bytes with it from now on
    movers.handed_off("new:1", "shm", 64)
    assert not movers.refused("new:1", error(grpc.StatusCode.INVALID_ARGUMENT, "CRC32"))  # a real refusal
    assert not movers.refused("new:1", error(grpc.StatusCode.RESOURCE_EXHAUSTED))
    assert movers.refused("new:1", error(grpc.StatusCode.FAILED_PRECONDITION, "shm handoff: moved to another pod"))


def test_decode_maps_only_the_very_segment_prefill_made() -> None:
    from crescent.services.kvwire.handoff_shm import ShmUnusable

    segment = HandoffSegment.create(instance_tag("test"), 4096)
    try:
        with pytest.raises(ShmUnusable, match="not prefill's segment"):  # same name, another file (another host)
            HandoffSegment.attach(segment.name, "another-boot:1:2", 4096)
        with pytest.raises(ShmUnusable, match="bytes"):
            HandoffSegment.attach(segment.name, segment.identity, 8192)
        with pytest.raises(ShmUnusable, match="not a handoff segment name"):
            HandoffSegment.attach("../etc/passwd", segment.identity, 4096)
        mapped = HandoffSegment.attach(segment.name, segment.identity, 4096)
        segment.buf[:5] = b"hello"
        assert bytes(mapped.buf[:5]) == b"hello"  # one memory, two mappings
        assert not (SHM_DIR / segment.name).exists()  # decode unlinked the name once mapped
        with pytest.raises(ShmUnusable, match="another host, pod or user"):
            HandoffSegment.attach(segment.name, segment.identity, 4096)
    finally:
        segment.unlink()
