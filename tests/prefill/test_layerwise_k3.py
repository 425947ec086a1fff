"""Layer-wise handoff of the hybrid kimi_k3 model: its MLA layers' latents go to decode a layer
at a time while prefill computes, the last block's KDA state once it is final.

What a user would notice: decode continues such a prompt to exactly the tokens one process
generates and the whole-block handoff gives, in fp32 and bf16 caches, whichever way the prompt
was cut into chunks or partly cached; the kvstore gets the very blocks (latents and fp32 state
snapshots) the whole-block path gives it; a stream that loses, repeats or reorders a layer
or the state is refused, never decoded. (Real processes: ``test_layerwise_k3_processes.py``.)
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from crescent.protos import common_pb2, decode_pb2
from crescent.services.engine.engine import Engine
from crescent.services.kvwire.chunk_wire import WireChunk
from crescent.services.kvwire.handoff_wire import HandoffWirePart, decode_part, encode_part
from crescent.services.kvwire.kv_block import BlockFormatError
from crescent.services.kvwire.layer_wire import LayerAssembler, block_tokens, layer_slice
from crescent.services.prefill.layerwise import LayerwiseHandoff, hands_off_layerwise, supports_layerwise
from crescent.services.prefill.prompt_export import PromptExport
from tests.engine.test_kimi_k3_snapshots import BF16_CFG, PAGE, TEST_CFG, make_engine, prompt


class InlineWorker:
    """The engine worker's ``run``, on this thread (the export copies blocks with snapshots)."""

    async def run(self, fn, *args):  # noqa: ANN001, ANN002, ANN201
        return fn(*args)


def stream(engine: Engine, tokens: list[int], seq_id: str = "s"):
    """Prefill ``tokens`` on a thread while a ``LayerwiseHandoff`` streams it through the wire
    codec; (the decoded parts, the whole-block payloads of the prompt, the export's payloads)."""
    async def main():
        seq = engine.add_sequence(seq_id, tokens)
        export = PromptExport(engine, InlineWorker(), seq, len(tokens))
        header = decode_pb2.HandoffHeader(request_id=seq_id, model_id="k3-test", prompt_token_ids=tokens)
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
        whole = [engine.block_payload(seq, i, block_tokens(i, len(tokens), PAGE)) for i in range(export.num_blocks)]
        exported = await export.payloads(range(export.num_blocks))
        shapes = [export.shape(i) for i in range(export.num_blocks)]
        engine.release(seq)
        return received, whole, list(zip(exported, shapes))
    return asyncio.run(main())


def assemble(engine: Engine, parts, prompt_tokens: int) -> list[memoryview]:
    header, *middle, tail = parts
    assert header.header.num_layers == len(TEST_CFG.mla_layers) and tail.tail.first_token_id == 7
    layers = LayerAssembler(engine.cache.layer_layout(), prompt_tokens, PAGE)
    for part in middle:
        assert not part.error
        layers.feed(part.layer) if part.layer is not None else layers.feed_state(part.state)
    return layers.payloads()


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def latents_only(engine: Engine, payload: torch.Tensor) -> bytes:
    """A payload's latents (without the state it may carry)."""
    tokens = engine.cache.payload_tokens(payload.shape)
    return as_bytes(payload.reshape(-1)[-tokens * engine.cache.block_shape[1] :])


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


@pytest.mark.parametrize("cfg", [TEST_CFG, BF16_CFG], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [40, 2048], ids=["chunked", "one-forward"])
def test_decode_continues_a_layerwise_k3_prompt_exactly(cfg, chunk) -> None:
    engine = make_engine(cfg=cfg, chunk=chunk)
    assert hands_off_layerwise(engine) and not supports_layerwise(engine)  # not the kvstore's layer-major copy
    tokens = prompt(6 * PAGE + 5)  # 6 full blocks (each with a snapshot) and a partial one
    parts, whole, exported = stream(engine, tokens)
    states = [p for p in parts if p.state is not None]
    assert len(states) == 1 and states[0].state.meta.nbytes == engine.cache.layer_layout().state_bytes
    assert parts.index(states[0]) < len(parts) - 1  # before the tail, with the last layers
    received = assemble(engine, parts, len(tokens))
    # decode gets every block's latents as prefill holds them, and the last block's live state exactly
    assert [bytes(b) for b in received[:-1]] == [latents_only(engine, w) for w in whole[:-1]]
    assert bytes(received[-1]) == as_bytes(whole[-1])
    # the kvstore export: every block as the whole-block path gives it, snapshots in (those blocks
    # copied again with their snapshot; the others, and the last with its live state, adopted)
    assert [(bytes(p), s) for p, s in exported] == [(as_bytes(w), tuple(w.shape)) for w in whole]
    assert sum(1 for _, s in exported if engine.cache.payload_has_state(s)) == 7

    reference = make_engine(cfg=cfg).generate(tokens, 6, stop_token_ids=[])
    decode = make_engine(cfg=cfg)
    wire = decode.cache.wire_dtype
    handed = [torch.frombuffer(bytearray(b), dtype=wire).view(
        decode.cache.payload_shape(block_tokens(i, len(tokens), PAGE), with_state=i == len(received) - 1))
        for i, b in enumerate(received)]
    assert continue_greedy(decode, tokens, reference[0], handed, 6) == reference
    assert continue_greedy(decode, tokens, reference[0], [w.clone() for w in whole], 6) == reference


def test_a_cached_k3_prefix_goes_first_whole_then_the_computed_layers() -> None:
    engine = make_engine(chunk=32)
    first = prompt(5 * PAGE + 3, seed=2)
    stream(engine, first, "a")  # leaves 5 full blocks with snapshots in the prefix cache
    tokens = first[: 4 * PAGE] + prompt(2 * PAGE + 7, seed=3)
    probe = engine.add_sequence("probe", tokens)
    engine.release(probe)
    assert probe.num_cached == 4 * PAGE  # the shared blocks are hits, resumed from the 4th's snapshot
    parts, whole, exported = stream(engine, tokens, "b")
    slices = [p.layer.meta for p in parts if p.layer is not None]
    hits = [(m.layer, m.first_block, m.num_blocks) for m in slices[: len(TEST_CFG.mla_layers)]]
    assert hits == [(m, 0, 4) for m in range(len(TEST_CFG.mla_layers))]  # every layer of the 4 hits, at once
    received = assemble(engine, parts, len(tokens))
    assert [bytes(b) for b in received[:-1]] == [latents_only(engine, w) for w in whole[:-1]]
    assert bytes(received[-1]) == as_bytes(whole[-1])
    reference = make_engine().generate(tokens, 4, stop_token_ids=[])
    decode = make_engine()
    handed = [torch.frombuffer(bytearray(b), dtype=torch.float32).view(
        decode.cache.payload_shape(block_tokens(i, len(tokens), PAGE), with_state=i == len(received) - 1))
        for i, b in enumerate(received)]
    assert continue_greedy(decode, tokens, reference[0], handed, 4) == reference


def test_prompts_sharing_forwards_and_a_small_snapshot_pool_each_get_their_own_states() -> None:
    """Two prompts' chunks in the same forwards (the prefill batcher's ``mixed_step``), with a
    pool of 3 snapshot slots for their 7 planned snapshots: each handoff carries its own live
    state, and the export carries the snapshots the pool kept, as the whole-block path does."""
    prompts = {"a": prompt(4 * PAGE + 3, seed=4), "b": prompt(3 * PAGE + 9, seed=5)}
    reference = run_together(make_engine(), prompts, streamed=False)[1]  # a pool with room for all
    engine = make_engine(slots=3)
    received, whole, exported = run_together(engine, prompts, streamed=True)
    assert len(engine.cache.snapshots) == 3
    for k, tokens in prompts.items():
        payloads = assemble(engine, received[k], len(tokens))
        assert bytes(payloads[-1]) == as_bytes(whole[k][-1]) == as_bytes(reference[k][-1])  # its own live state
        assert [bytes(b) for b in payloads[:-1]] == [latents_only(engine, w) for w in reference[k][:-1]]
        assert [(bytes(p), shape) for p, shape in exported[k]] == [(as_bytes(w), tuple(w.shape)) for w in whole[k]]
        for w, r in zip(whole[k], reference[k]):  # a kept snapshot is the one a roomy pool keeps
            assert as_bytes(w) == (as_bytes(r) if engine.cache.payload_has_state(w.shape) else latents_only(engine, r))
    assert sum(engine.cache.payload_has_state(w.shape) for ws in whole.values() for w in ws) == 3 + 2


def run_together(engine: Engine, prompts: dict[str, list[int]], streamed: bool):
    """Compute ``prompts`` in shared forwards of up to 24 tokens each, with layer-wise handoffs if
    ``streamed``: (the parts each stream sent, the whole-block payloads afterwards, the exports)."""
    async def main():
        seqs = {k: engine.add_sequence(k, t) for k, t in prompts.items()}
        exports = {k: PromptExport(engine, InlineWorker(), seqs[k], len(t)) for k, t in prompts.items()}
        received: dict[str, list] = {k: [] for k in prompts}
        handoffs = {k: LayerwiseHandoff(engine, seqs[k], exports[k], decode_pb2.HandoffHeader(
            request_id=k, prompt_token_ids=prompts[k])) for k in prompts} if streamed else {}
        for k, handoff in handoffs.items():
            async def call(parts, k=k):
                async for part in parts:
                    received[k].append(decode_part(encode_part(part)))
                return decode_pb2.HandoffReply(accepted=True)
            handoff.start(call)

        def compute() -> None:  # forwards of up to 24 tokens of each prompt, both in each forward
            while any(s.num_computed < s.num_tokens for s in seqs.values()):
                step = [(s, min(s.num_tokens, s.num_computed + 24)) for s in seqs.values() if s.num_computed < s.num_tokens]
                engine.mixed_step(step, [], on_layer=lambda layer: [handoffs[s.seq_id].on_layer(layer, end)
                                                                    for s, end in step if handoffs])
        await asyncio.to_thread(compute)
        whole, exported = {}, {}
        for k, handoff in handoffs.items():
            await handoff.finish([7], [])
            await handoff.close()
        for k, seq in seqs.items():
            n = exports[k].num_blocks
            whole[k] = [engine.block_payload(seq, i, block_tokens(i, len(prompts[k]), PAGE)) for i in range(n)]
            if streamed:
                exported[k] = list(zip(await exports[k].payloads(range(n)), [exports[k].shape(i) for i in range(n)]))
        return received, whole, exported

    return asyncio.run(main())


# ---- what decode refuses ---------------------------------------------------------------------------

def feed_all(engine: Engine, prompt_tokens: int, order: list[tuple[int, int]], states: int = 1,
             state_bytes: int | None = None) -> LayerAssembler:
    """Feed zero slices in ``order`` ((layer, block) pairs), then ``states`` states, through the codec."""
    layout = engine.cache.layer_layout()
    layers = LayerAssembler(layout, prompt_tokens, PAGE)
    for layer, b in order:
        tokens = block_tokens(b, prompt_tokens, PAGE)
        part = HandoffWirePart(layer=layer_slice(layer, b, [memoryview(bytes(tokens * layout.token_layer_bytes))], tokens))
        layers.feed(decode_part(encode_part(part)).layer)
    size = layout.state_bytes if state_bytes is None else state_bytes
    for _ in range(states):
        meta = common_pb2.BlockMeta(key=b"r/state", dtype="float32", shape=[size // 4], nbytes=size, found=True)
        part = HandoffWirePart(state=WireChunk(meta=meta, data=bytes(size), last=True))
        layers.feed_state(decode_part(encode_part(part)).state)
    return layers


def test_a_missing_repeated_or_reordered_k3_layer_or_state_is_an_error() -> None:
    engine = make_engine()
    m = len(TEST_CFG.mla_layers)
    order = [(layer, b) for b in range(3) for layer in range(m)]
    assert len(feed_all(engine, 40, order).payloads()) == 3
    with pytest.raises(BlockFormatError, match=f"layer {m - 1} of block 2 never arrived"):
        feed_all(engine, 40, order[:-1]).payloads()
    with pytest.raises(BlockFormatError, match="state of the last block never arrived"):
        feed_all(engine, 40, order, states=0).payloads()
    with pytest.raises(BlockFormatError, match="state arrived again"):
        feed_all(engine, 40, order, states=2)
    with pytest.raises(BlockFormatError, match="layer 0 of block 0 arrived again"):
        feed_all(engine, 40, [order[0], order[0]])
    with pytest.raises(BlockFormatError, match="layer 1 of block 0 arrived before layer 0"):
        feed_all(engine, 40, [(1, 0)])
    with pytest.raises(BlockFormatError, match=f"layer {m} of a {m}-layer handoff"):
        feed_all(engine, 40, [(m, 0)])
    with pytest.raises(BlockFormatError, match="recurrent state of 12 bytes"):
        feed_all(engine, 40, [], state_bytes=12)
