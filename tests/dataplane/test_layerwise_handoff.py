"""Layer-wise handoff in one process, both model families: the KV goes to decode a layer at a
time while prefill computes (kimi_k3: its MLA layers' latents, the last block's KDA state once
final).

What a user would notice: decode gets exactly the bytes prefill's cache holds and continues the
prompt to the tokens one process generates, whichever way the prompt was cut into chunks or
partly cached, in fp32 and bf16 caches; the kvstore export reads the same buffers (nothing copied
twice) and gets the very blocks the whole-block path gives it; a stream that loses, repeats or
reorders a layer (or the state) is refused, never decoded on a half-filled cache; the engine
tells each layer as it is done. (Real processes: ``test_processes.py``.)
"""

from __future__ import annotations

import asyncio

import pytest

from crescent.protos import decode_pb2
from crescent.services.engine.engine import Engine
from crescent.services.kvwire.handoff_wire import decode_part, encode_part
from crescent.services.kvwire.kv_block import BlockFormatError
from crescent.services.kvwire.layer_wire import LayerAssembler, LayerLayout, block_tokens
from crescent.services.prefill.layerwise import LayerwiseHandoff, hands_off_layerwise, supports_layerwise
from crescent.services.prefill.layerwise_store import stores_layerwise
from crescent.services.prefill.prompt_export import PromptExport
from tests.dataplane.families import (FAMILIES, K3, LLAMA, InlineWorker, as_bytes, assemble, continue_greedy,
                                      feed_all, handed_payloads, k3_engine, latents_only, layer_part,
                                      stream_layerwise)
from tests.engine.test_kimi_k3_snapshots import BF16_CFG


# (family, engine factory, chunk tokens, prompt tokens): llama's 5 full blocks and a partial one in 3
# chunks of 8 or one forward; kimi_k3's 6 full blocks (each with a snapshot) and a partial one
CASES = [
    pytest.param(LLAMA, LLAMA.make_engine, 8, 23, id="llama-chunked"),
    pytest.param(LLAMA, LLAMA.make_engine, 64, 23, id="llama-one-forward"),
    pytest.param(K3, k3_engine, 40, 6 * K3.page + 5, id="k3-fp32-chunked"),
    pytest.param(K3, lambda **kw: k3_engine(BF16_CFG, **kw), 40, 6 * K3.page + 5, id="k3-bf16-chunked"),
    pytest.param(K3, k3_engine, 2048, 6 * K3.page + 5, id="k3-fp32-one-forward"),
    pytest.param(K3, lambda **kw: k3_engine(BF16_CFG, **kw), 2048, 6 * K3.page + 5, id="k3-bf16-one-forward"),
]


@pytest.mark.parametrize(("family", "make", "chunk", "n"), CASES)
def test_decode_gets_exactly_the_cache_s_bytes_and_continues_the_prompt_exactly(family, make, chunk, n) -> None:
    engine = make(chunk=chunk)
    assert hands_off_layerwise(engine)
    tokens = family.prompt(n, 1) if family is K3 else [(5 * i + 3) % 97 for i in range(n)]
    streamed = stream_layerwise(engine, tokens)
    received = assemble(engine, streamed.parts, len(tokens))
    whole = streamed.whole
    # decode gets every block's KV as prefill holds it, and a stateful last block's live state exactly
    assert [bytes(b) for b in received[:-1]] == [latents_only(engine, w) for w in whole[:-1]]
    assert bytes(received[-1]) == as_bytes(whole[-1])
    # the kvstore export: every block as the whole-block path gives it
    assert [(bytes(p), s) for p, s in streamed.exported] == [(as_bytes(w), tuple(w.shape)) for w in whole]
    reference = make().generate(tokens, 6, stop_token_ids=[])
    decode = make(chunk=chunk)
    assert continue_greedy(decode, tokens, reference[0], handed_payloads(decode, received, len(tokens)), 6) == reference
    assert continue_greedy(decode, tokens, reference[0], [w.clone() for w in whole], 6) == reference
    if family is LLAMA:
        # layer-major blocks; decode adopts them (as its servicer does) and holds, page for page, prefill's bytes
        layout = LayerLayout.layer_major(engine.config.num_layers, engine.cache.token_layer_bytes())
        layers = LayerAssembler(layout, len(tokens), family.page)
        for part in streamed.parts[1:-1]:
            layers.feed(part.layer)
        assert [bytes(b) for b in layers.payloads()] == [as_bytes(w) for w in whole]
        adopted = decode.adopt_sequence("d2", tokens, len(tokens), handed_payloads(decode, received, len(tokens)))
        assert [as_bytes(decode.block_payload(adopted, i, block_tokens(i, len(tokens), family.page)))
                for i in range(len(whole))] == [as_bytes(w) for w in whole]
        # the kvstore export reads the same buffers: nothing copied twice
        assert streamed.copied_bytes == sum(len(as_bytes(w)) for w in whole)
    else:
        states = [p for p in streamed.parts if p.state is not None]
        assert len(states) == 1 and states[0].state.meta.nbytes == engine.cache.layer_layout().state_bytes
        assert streamed.parts.index(states[0]) < len(streamed.parts) - 1  # before the tail, with the last layers
        # snapshots in: those blocks copied again with their snapshot; the others (and the last,
        # with its live state) adopted from the handoff's buffers
        assert sum(1 for _, s in streamed.exported if engine.cache.payload_has_state(s)) == 7


@pytest.mark.parametrize(("family", "chunk"), [(LLAMA, 8), (K3, 32)], ids=["llama", "k3"])
def test_a_cached_prefix_goes_first_whole_then_the_computed_layers(family, chunk) -> None:
    engine = family.make_engine(chunk=chunk)
    page, layers = family.page, engine.cache.layer_layout().num_layers
    first = family.prompt(5 * page + 3, 2)
    stream_layerwise(engine, first, "a")  # leaves 5 full blocks (kimi_k3: with snapshots) in the prefix cache
    tokens = first[: 4 * page] + family.prompt(2 * page + 7, 3)
    streamed = stream_layerwise(engine, tokens, "b")
    assert streamed.num_cached == 4 * page  # the shared blocks are hits (kimi_k3: resumed from the 4th's snapshot)
    slices = [p.layer.meta for p in streamed.parts if p.layer is not None]
    hits = [(m.layer, m.first_block, m.num_blocks) for m in slices[:layers]]
    assert hits == [(m, 0, 4) for m in range(layers)]  # every layer of the 4 hits, at once, first
    received = assemble(engine, streamed.parts, len(tokens))
    assert [bytes(b) for b in received[:-1]] == [latents_only(engine, w) for w in streamed.whole[:-1]]
    assert bytes(received[-1]) == as_bytes(streamed.whole[-1])
    reference = family.make_engine().generate(tokens, 4, stop_token_ids=[])
    decode = family.make_engine()
    assert continue_greedy(decode, tokens, reference[0], handed_payloads(decode, received, len(tokens)), 4) == reference


@pytest.mark.parametrize(("family", "chunk", "n", "ends"), [(LLAMA, 8, 20, (8, 16, 20)), (K3, 2048, 40, (40,))],
                         ids=["llama", "k3"])
def test_the_engine_tells_each_layer_of_each_forward_in_order(family, chunk, n, ends) -> None:
    engine = family.make_engine(chunk=chunk)
    seq = engine.add_sequence("s", family.prompt(n, 1))
    seen: list[tuple[int, int]] = []
    engine.prefill(seq, lambda layer, end: seen.append((layer, end)))
    assert seen == [(layer, end) for end in ends for layer in range(engine.config.num_layers)]
    # llama's payloads lie layer after layer: the kvstore export copies each layer into one range of a
    # block; kimi_k3's are token-major with states: layer-wise to decode, and its own export's way
    assert hands_off_layerwise(engine) and stores_layerwise(engine)
    assert supports_layerwise(engine) == (family is LLAMA)


def test_k3_prompts_sharing_forwards_and_a_small_snapshot_pool_each_get_their_own_states() -> None:
    """Two prompts' chunks in the same forwards (the prefill batcher's ``mixed_step``), with a
    pool of 3 snapshot slots for their 7 planned snapshots: each handoff carries its own live
    state, and the export carries the snapshots the pool kept, as the whole-block path does."""
    page = K3.page
    prompts = {"a": K3.prompt(4 * page + 3, 4), "b": K3.prompt(3 * page + 9, 5)}
    reference = run_together(K3.make_engine(), prompts, streamed=False)[1]  # a pool with room for all
    engine = K3.make_engine(slots=3)
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
    page = K3.page

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
            whole[k] = [engine.block_payload(seq, i, block_tokens(i, len(prompts[k]), page)) for i in range(n)]
            if streamed:
                exported[k] = list(zip(await exports[k].payloads(range(n)), [exports[k].shape(i) for i in range(n)]))
        return received, whole, exported

    return asyncio.run(main())


# ---- what decode refuses ---------------------------------------------------------------------------

def _layers(family) -> int:  # noqa: ANN001
    return family.make_engine().cache.layer_layout().num_layers


# (family, case, slices as f(layers, every slice in order), states, state bytes, message); a prompt of
# 3 blocks (2 full, 2 tokens more); None: the stream assembles into 3 blocks
BROKEN = [
    (family, name, order, states if family.stateful else 0, size, says)
    for family in FAMILIES
    for name, order, states, size, says in [
        ("whole", lambda m, every: every, 1, None, None),
        ("missing", lambda m, every: every[:-1], 1, None, "layer {m1} of block 2 never arrived"),
        ("twice", lambda m, every: [every[0], every[0]], 1, None, "layer 0 of block 0 arrived again"),
        ("reordered", lambda m, every: [(1, 0)], 1, None, "layer 1 of block 0 arrived before layer 0"),
    ]
] + [
    (LLAMA, "past-the-prompt", lambda m, every: [(0, 3)], 0, None, "blocks \\[3, 4\\) of a 3-block prompt"),
    (K3, "no-state", lambda m, every: every, 0, None, "state of the last block never arrived"),
    (K3, "two-states", lambda m, every: every, 2, None, "state arrived again"),
    (K3, "no-such-layer", lambda m, every: [(m, 0)], 1, None, "layer {m} of a {m}-layer handoff"),
    (K3, "short-state", lambda m, every: [], 1, 12, "recurrent state of 12 bytes"),
]


@pytest.mark.parametrize(("family", "name", "order", "states", "state_bytes", "says"), BROKEN,
                         ids=[f"{c[0]}-{c[1]}" for c in BROKEN])
def test_a_missing_repeated_or_reordered_layer_or_state_is_an_error(family, name, order, states, state_bytes,
                                                                     says) -> None:
    engine = family.make_engine()
    m, prompt_tokens = engine.cache.layer_layout().num_layers, 2 * family.page + 2
    every = [(layer, b) for b in range(3) for layer in range(m)]
    if says is None:
        assert len(feed_all(engine, prompt_tokens, order(m, every), states, state_bytes).payloads()) == 3
        return
    with pytest.raises(BlockFormatError, match=says.format(m=m, m1=m - 1)):
        feed_all(engine, prompt_tokens, order(m, every), states, state_bytes).payloads()


def test_a_llama_slice_of_the_wrong_size_is_an_error() -> None:
    engine = LLAMA.make_engine()
    with pytest.raises(BlockFormatError, match="bytes"):
        layers = LayerAssembler(engine.cache.layer_layout(), 10, LLAMA.page)
        layers.feed(decode_part(encode_part(layer_part(0, 0, b"short", LLAMA.page))).layer)
