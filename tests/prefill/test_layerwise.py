"""Layer-wise handoff: the KV goes to decode a layer at a time while prefill computes.

What a user would notice: decode gets exactly the bytes prefill's cache holds, whichever way
the prompt was cut into chunks or partly cached; a stream that loses, repeats or reorders a
layer is refused, never decoded on a half-filled cache; the engine tells each layer as it is
done, for both model families. (A real prefill and decode process on loopback, layer-wise and
not, decode the same tokens as one process: ``test_kv_wire.py``.)
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from crescent.protos import decode_pb2
from crescent.services.engine.engine import Engine
from crescent.services.kvwire.handoff_wire import decode_part, encode_part
from crescent.services.kvwire.kv_block import BlockFormatError
from crescent.services.kvwire.layer_wire import LayerAssembler, LayerLayout, block_tokens, layer_slice
from crescent.services.prefill.layerwise import LayerwiseHandoff, hands_off_layerwise, supports_layerwise
from crescent.services.prefill.prompt_export import PromptExport
from tests.engine.tiny_model import tiny_model

PAGE = 4


def make_engine(chunk: int = 8) -> Engine:
    torch.set_num_threads(1)
    return Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=64 * PAGE, block_size=PAGE,
                  prefill_chunk_tokens=chunk)


def stream(engine: Engine, tokens: list[int], seq_id: str = "s"):
    """Prefill ``tokens`` on a thread while a ``LayerwiseHandoff`` streams it through the wire
    codec; (the decoded parts, the sequence, the export)."""
    async def main():
        seq = engine.add_sequence(seq_id, tokens)
        export = PromptExport(engine, None, seq, len(tokens))
        header = decode_pb2.HandoffHeader(request_id=seq_id, prompt_token_ids=tokens)
        streamed = LayerwiseHandoff(engine, seq, export, header)
        received = []

        async def call(parts):  # what decode reads: each part encoded and decoded
            async for part in parts:
                received.append(decode_part(encode_part(part)))
            return decode_pb2.HandoffReply(accepted=True)

        streamed.start(call)
        await asyncio.to_thread(engine.prefill, seq, streamed.on_layer)
        await streamed.finish([7], [])
        await streamed.close()
        return received, seq, export
    return asyncio.run(main())


def assemble(engine: Engine, parts, prompt: int) -> list[bytes]:
    header, *slices, tail = parts
    assert header.header.num_layers == engine.config.num_layers and tail.tail.first_token_id == 7
    layers = LayerAssembler(LayerLayout.layer_major(header.header.num_layers, engine.cache.token_layer_bytes()), prompt, PAGE)
    for part in slices:
        assert not part.error and part.layer is not None
        layers.feed(part.layer)
    return [bytes(b) for b in layers.payloads()]


def prompt_bytes(engine: Engine, seq, prompt: int) -> list[bytes]:
    return [engine.block_payload(seq, i, block_tokens(i, prompt, PAGE)).contiguous().view(torch.uint8).numpy().tobytes()
            for i in range(-(-prompt // PAGE))]


@pytest.mark.parametrize("chunk", [8, 64])
def test_decode_assembles_exactly_the_bytes_in_prefill_s_cache(chunk) -> None:
    engine = make_engine(chunk)
    tokens = [(5 * i + 3) % 97 for i in range(23)]  # 5 full blocks and a partial one; 3 chunks of 8 or one
    parts, seq, export = stream(engine, tokens)
    expected = prompt_bytes(engine, seq, len(tokens))
    received = assemble(engine, parts, len(tokens))
    assert received == expected
    # decode adopts them (as its servicer does) and holds, page for page, prefill's bytes
    decode = make_engine(chunk)
    payloads = [torch.frombuffer(bytearray(b), dtype=torch.float32).view(
        decode.cache.payload_shape(block_tokens(i, len(tokens), PAGE))) for i, b in enumerate(received)]
    adopted = decode.adopt_sequence("d", tokens, len(tokens), payloads)
    assert prompt_bytes(decode, adopted, len(tokens)) == expected
    # the kvstore export reads the same buffers: nothing copied twice
    assert export.copied_bytes == sum(len(b) for b in expected)
    assert [bytes(p) for p in asyncio.run(export.payloads(range(len(expected))))] == expected


def test_a_cached_prefix_goes_first_then_the_computed_layers() -> None:
    engine = make_engine()
    first = [(7 * i + 1) % 97 for i in range(17)]
    stream(engine, first, "a")  # leaves 4 full blocks in the prefix cache
    tokens = first[:16] + [11, 12, 13, 14, 15, 16]
    parts, seq, _ = stream(engine, tokens, "b")
    assert seq.num_cached == 16  # the 4 blocks are hits
    first_computed = next(i for i, p in enumerate(parts[1:-1]) if p.layer.meta.first_block >= 4)
    assert {p.layer.meta.first_block for p in parts[1 : 1 + first_computed]} == {0}  # the hits, each layer
    assert assemble(engine, parts, len(tokens)) == prompt_bytes(engine, seq, len(tokens))


def test_the_engine_tells_each_layer_of_each_chunk_in_order() -> None:
    engine = make_engine(chunk=8)
    seq = engine.add_sequence("s", list(range(1, 21)))
    seen: list[tuple[int, int]] = []
    engine.prefill(seq, lambda layer, end: seen.append((layer, end)))
    assert seen == [(layer, end) for end in (8, 16, 20) for layer in range(engine.config.num_layers)]


def test_a_kimi_forward_tells_each_layer_too() -> None:
    from tests.engine.test_kimi_k3_snapshots import make_engine as k3_engine, prompt

    engine = k3_engine()
    seq = engine.add_sequence("k", prompt(40))
    seen: list[tuple[int, int]] = []
    engine.prefill(seq, lambda layer, end: seen.append((layer, end)))
    assert seen == [(layer, 40) for layer in range(engine.config.num_layers)]
    # its payloads are token-major with states: layer-wise to decode (test_layerwise_k3.py), but
    # not through a copy of each layer into one range of a block (the layer-wise kvstore export)
    assert hands_off_layerwise(engine) and not supports_layerwise(engine)


# ---- what decode refuses ---------------------------------------------------------------------------

def slices(engine: Engine, prompt: int) -> list[tuple[int, int]]:
    """(layer, block) of every slice a one-block-per-message stream sends, in order."""
    return [(layer, b) for b in range(-(-prompt // PAGE)) for layer in range(engine.config.num_layers)]


def feed_all(engine: Engine, prompt: int, order: list[tuple[int, int]]) -> LayerAssembler:
    per_token = engine.cache.token_layer_bytes()
    layers = LayerAssembler(LayerLayout.layer_major(engine.config.num_layers, per_token), prompt, PAGE)
    for layer, b in order:
        tokens = max(block_tokens(b, prompt, PAGE), 1)
        part = decode_part(encode_part(_layer_part(layer, b, bytes(tokens * per_token), tokens)))
        layers.feed(part.layer)
    return layers


def _layer_part(layer: int, block: int, data: bytes, tokens: int):
    from crescent.services.kvwire.handoff_wire import HandoffWirePart

    return HandoffWirePart(layer=layer_slice(layer, block, [memoryview(data)], tokens))


def test_a_missing_duplicated_or_reordered_layer_is_an_error() -> None:
    engine = make_engine()
    order = slices(engine, 10)
    assert len(feed_all(engine, 10, order).payloads()) == 3
    with pytest.raises(BlockFormatError, match="layer 1 of block 2 never arrived"):
        feed_all(engine, 10, order[:-1]).payloads()
    with pytest.raises(BlockFormatError, match="layer 0 of block 0 arrived again"):
        feed_all(engine, 10, [order[0], order[0]])
    with pytest.raises(BlockFormatError, match="layer 1 of block 0 arrived before layer 0"):
        feed_all(engine, 10, [(1, 0)])
    with pytest.raises(BlockFormatError, match="blocks \\[3, 4\\) of a 3-block prompt"):
        feed_all(engine, 10, [(0, 3)])
    with pytest.raises(BlockFormatError, match="bytes"):
        layers = LayerAssembler(engine.cache.layer_layout(), 10, PAGE)
        layers.feed(decode_part(encode_part(_layer_part(0, 0, b"short", PAGE))).layer)
