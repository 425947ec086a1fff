"""What the data-plane matrix shares: the two model families, the in-process layer-wise stream,
the broken streams decode must refuse, and reading a kvstore node back.

The matrix is {layer-wise handoff, layer-wise kvstore export} x {llama, kimi_k3} x {in-process,
real processes}: ``test_layerwise_handoff.py``, ``test_layerwise_store.py`` (in-process, a real
kvstore node for the export) and ``test_processes.py``. A ``Family`` says how to build each
model's engine and prompts; the tests take it as a parameter where their checks are the same,
and keep what only one family has (kimi_k3's recurrent states and snapshot pool) as their own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import torch
from prometheus_client import REGISTRY

from crescent.protos import common_pb2, decode_pb2
from crescent.services.engine.cache_api import StatefulKvCache
from crescent.services.engine.engine import Engine
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvwire.chunk_wire import WireChunk
from crescent.services.kvwire.handoff_wire import HandoffWirePart, decode_part, encode_part
from crescent.services.kvwire.layer_wire import LayerAssembler, block_tokens, layer_slice
from crescent.services.prefill.layerwise import LayerwiseHandoff
from crescent.services.prefill.prompt_export import PromptExport
from tests.engine import test_kimi_k3_snapshots as k3
from tests.engine.tiny_model import tiny_model

LLAMA_PAGE = 4
K3_PAGE = k3.PAGE  # 16
MIB = 1 << 20


def llama_engine(chunk: int = 8) -> Engine:
    """The tiny llama model, 64 pages of 4 tokens."""
    torch.set_num_threads(1)
    return Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=64 * LLAMA_PAGE, block_size=LLAMA_PAGE,
                  prefill_chunk_tokens=chunk)


def prompt_bytes(engine: Engine, seq, prompt: int) -> list[bytes]:  # noqa: ANN001
    """The prompt's blocks as ``engine``'s cache holds them for ``seq``."""
    page = engine.block_size
    return [as_bytes(engine.block_payload(seq, i, block_tokens(i, prompt, page))) for i in range(-(-prompt // page))]


def llama_prompt(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7 + 5 * i + 3) % 97 for i in range(n)]


@dataclass(frozen=True)
class Family:
    """One model family of the matrix: its engines, prompts and block size."""

    name: str
    page: int
    make_engine: Callable[..., Engine]  # (chunk=...) -> a fresh engine
    prompt: Callable[..., list[int]]    # (n, seed) -> n prompt tokens
    stateful: bool                      # its last block carries a recurrent state (kimi_k3)

    def __str__(self) -> str:  # the test ids
        return self.name


def k3_engine(cfg=k3.TEST_CFG, **kwargs) -> Engine:  # noqa: ANN001, ANN003
    """The tiny kimi_k3 model with ``cfg`` (``k3.BF16_CFG``: bf16 latents, fp32 states)."""
    return k3.make_engine(cfg=cfg, **kwargs)


LLAMA = Family("llama", LLAMA_PAGE, llama_engine, llama_prompt, stateful=False)
K3 = Family("k3", K3_PAGE, k3.make_engine, k3.prompt, stateful=True)
FAMILIES = [LLAMA, K3]


class InlineWorker:
    """The engine worker's ``run``, on this thread (the export copies blocks with snapshots)."""

    async def run(self, fn, *args):  # noqa: ANN001, ANN002, ANN201
        return fn(*args)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def latents_only(engine: Engine, payload: torch.Tensor) -> bytes:
    """A payload's KV (without the state a kimi_k3 block may carry)."""
    if not isinstance(engine.cache, StatefulKvCache):
        return as_bytes(payload)
    tokens = engine.cache.payload_tokens(payload.shape)
    return as_bytes(payload.reshape(-1)[-tokens * engine.cache.block_shape[1] :])


@dataclass
class Streamed:
    """A prompt handed off layer-wise in this process."""

    parts: list                 # what decode read, each part through the wire codec
    whole: list[torch.Tensor]   # the prompt's blocks as the cache holds them afterwards
    exported: list[tuple[memoryview, tuple[int, ...]]]  # the kvstore export's payloads and shapes
    copied_bytes: int           # copied out of the cache (by the handoff) before the export read
    num_cached: int             # prompt tokens that were prefix hits


def stream_layerwise(engine: Engine, tokens: list[int], seq_id: str = "s") -> Streamed:
    """Prefill ``tokens`` on a thread while a ``LayerwiseHandoff`` streams it through the wire
    codec; then what decode read, the cache's blocks and the export's. The sequence is released."""
    page = engine.block_size

    async def main() -> Streamed:
        seq = engine.add_sequence(seq_id, tokens)
        export = PromptExport(engine, InlineWorker(), seq, len(tokens))
        header = decode_pb2.HandoffHeader(request_id=seq_id, model_id=engine.model_id, prompt_token_ids=tokens)
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
        copied = export.copied_bytes
        n = export.num_blocks
        whole = [engine.block_payload(seq, i, block_tokens(i, len(tokens), page)).clone() for i in range(n)]
        exported = list(zip(await export.payloads(range(n)), [export.shape(i) for i in range(n)]))
        engine.release(seq)
        return Streamed(received, whole, exported, copied, seq.num_cached)
    return asyncio.run(main())


def assemble(engine: Engine, parts: list, prompt_tokens: int) -> list[memoryview]:
    """Decode's assembly of a layer-wise stream (header, slices and state, tail) into blocks."""
    header, *middle, tail = parts
    assert header.header.num_layers == engine.cache.layer_layout().num_layers and tail.tail.first_token_id == 7
    layers = LayerAssembler(engine.cache.layer_layout(), prompt_tokens, engine.block_size)
    for part in middle:
        assert not part.error
        layers.feed(part.layer) if part.layer is not None else layers.feed_state(part.state)
    return layers.payloads()


def handed_payloads(engine: Engine, received: list, prompt_tokens: int) -> list[torch.Tensor]:
    """Assembled blocks as decode's cache payloads (a stateful family's last with its state)."""
    cache, page = engine.cache, engine.block_size
    stateful = cache.layer_layout().state_bytes > 0

    def shape(i: int) -> tuple[int, ...]:
        tokens = block_tokens(i, prompt_tokens, page)
        return cache.payload_shape(tokens, with_state=i == len(received) - 1) if stateful else cache.payload_shape(tokens)

    return [torch.frombuffer(bytearray(b), dtype=cache.wire_dtype).view(shape(i)) for i, b in enumerate(received)]


def continue_greedy(engine: Engine, tokens: list[int], first: int, payloads: list[torch.Tensor], n: int) -> list[int]:
    """Decode ``n`` tokens after ``first`` on the handed-off ``payloads``, as decode does."""
    seq = engine.adopt_sequence("d", [*tokens, first], len(tokens), payloads, reserve_tokens=len(tokens) + n + 1)
    out = [first]
    try:
        while len(out) < n:
            out.append(int(torch.argmax(engine.decode_step([seq])[0])))
            seq.token_ids.append(out[-1])
    finally:
        engine.release(seq)
    return out


# ---- broken layer-wise streams --------------------------------------------------------------------

def layer_part(layer: int, block: int, data: bytes, tokens: int) -> HandoffWirePart:
    return HandoffWirePart(layer=layer_slice(layer, block, [memoryview(data)], tokens))


def state_part(nbytes: int) -> HandoffWirePart:
    meta = common_pb2.BlockMeta(key=b"r/state", dtype="float32", shape=[nbytes // 4], nbytes=nbytes, found=True)
    return HandoffWirePart(state=WireChunk(meta=meta, data=bytes(nbytes), last=True))


def feed_all(engine: Engine, prompt_tokens: int, order: list[tuple[int, int]], states: int = 0,
             state_bytes: int | None = None) -> LayerAssembler:
    """Feed zero slices in ``order`` ((layer, block) pairs), then ``states`` states, through the codec."""
    layout, page = engine.cache.layer_layout(), engine.block_size
    layers = LayerAssembler(layout, prompt_tokens, page)
    for layer, b in order:
        tokens = max(block_tokens(b, prompt_tokens, page), 1)  # a block past the prompt: one token
        part = layer_part(layer, b, bytes(tokens * layout.token_layer_bytes), tokens)
        layers.feed(decode_part(encode_part(part)).layer)
    for _ in range(states):
        part = state_part(layout.state_bytes if state_bytes is None else state_bytes)
        layers.feed_state(decode_part(encode_part(part)).state)
    return layers


def broken_stream(engine: Engine, request_id: str, tokens: list[int], order: list[tuple[int, int]],
                  states: int, tail: bool = True) -> Iterator[HandoffWirePart]:
    """A layer-wise Handoff stream of ``tokens`` with zero KV: header, slices in ``order``,
    ``states`` states, the tail (unless not ``tail``)."""
    layout, page = engine.cache.layer_layout(), engine.block_size
    yield HandoffWirePart(header=decode_pb2.HandoffHeader(
        request_id=request_id, model_id=engine.model_id, prompt_token_ids=tokens, num_layers=layout.num_layers,
        sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True), kv_dtype="float32",
        kv_block_shape=list(engine.cache.block_shape), num_blocks=-(-len(tokens) // page)))
    for layer, block in order:
        size = block_tokens(block, len(tokens), page)
        yield layer_part(layer, block, bytes(layout.layer_bytes(size)), size)
    for _ in range(states):
        yield state_part(layout.state_bytes)
    if tail:
        yield HandoffWirePart(tail=decode_pb2.HandoffTail(first_token_id=1))


# ---- a kvstore node, read back --------------------------------------------------------------------

def mover_bytes(address: str, mover: str) -> float:
    """Bytes this process's kvstore client put through ``mover`` to the node at ``address``."""
    return REGISTRY.get_sample_value("crescent_kv_mover_bytes_total",
                                     {"peer": address, "mover": mover, "direction": "put"}) or 0.0


def stored_blocks(address: str, want: int) -> list:
    """The node's blocks once it holds ``want`` of them, by key order."""
    async def main():
        client = KvStoreClient(address, shared_memory=True)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                listed = await client.list_blocks()
                if listed is not None and len(listed.blocks) >= want:
                    keys = sorted(bytes(b.key) for b in listed.blocks)
                    got = await client.get(keys)
                    return [got[k] for k in keys]
                await asyncio.sleep(0.1)
            raise TimeoutError(f"the node holds fewer than {want} blocks")
        finally:
            await client.close()
    return asyncio.run(main())


async def through_the_wire(parts) -> AsyncIterator[HandoffWirePart]:  # noqa: ANN001 - a plain or an async iterable
    """``parts`` as decode's Handoff reads them (gRPC takes a plain or an async iterator): each
    encoded and decoded by the wire codec."""
    if hasattr(parts, "__aiter__"):
        async for part in parts:
            yield decode_part(encode_part(part))
    else:
        for part in parts:
            yield decode_part(encode_part(part))
