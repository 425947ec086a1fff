"""A real prefill process batches concurrent prompts, and nobody can tell from the answers.

Several prompts of mixed lengths, two of them extending a cached prefix, are sent at once to a
prefill process on loopback; then, under another cache salt (so the same prefix hits and
misses happen again), each is sent alone. What a user would notice is the same: first tokens,
cached-token counts and the KV blocks handed to decode (recorded by a stand-in decode server)
are equal byte for byte. What an operator sees differs: prefill's prompts-per-forward histogram
(``crescent_engine_batch_size{role="prefill"}``) shows forwards of several prompts only in the
concurrent phase.
"""

from __future__ import annotations

import math
import threading
from concurrent import futures

import grpc
import pytest
import torch

from crescent.protos import common_pb2, decode_pb2, prefill_pb2, prefill_pb2_grpc
from crescent.services.kvwire.chunk_wire import WireChunk
from crescent.services.kvwire.layer_wire import LayerAssembler, LayerLayout
from tests.decode.process import BLOCK, DecodeProcess, SchedulerStandIn

pytestmark = pytest.mark.slow  # a real process: a model load

VOCAB = 49152  # the default model's (SmolLM2)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(10, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


BASE = tokens(5 * BLOCK + 10, seed=1)  # longer than min_cached_prompt_tokens, so it leaves blocks
PROMPTS = [
    BASE[: 4 * BLOCK] + tokens(40, seed=2),   # a hit of 4 blocks
    tokens(300, seed=3),
    tokens(70, seed=4),
    BASE[: 5 * BLOCK] + tokens(100, seed=5),  # a hit of 5 blocks
    tokens(150, seed=6),
    tokens(20, seed=7),
]


class RecordingDecode:
    """Decode's Handoff, answered ``accepted`` after keeping each request's block payloads
    (assembled from their layer slices: prefill hands off layer-wise by default)."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[bytes]] = {}
        handler = grpc.method_handlers_generic_handler("crescent.v1.Decode", {
            "Handoff": grpc.stream_unary_rpc_method_handler(
                self._handoff, request_deserializer=decode_pb2.HandoffPart.FromString,
                response_serializer=decode_pb2.HandoffReply.SerializeToString),
        })
        self.server = grpc.server(futures.ThreadPoolExecutor(8), handlers=[handler],
                                  options=[("grpc.max_receive_message_length", 80 << 20)])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _handoff(self, parts, context) -> decode_pb2.HandoffReply:
        header, blobs, layers = None, [], None
        for part in parts:
            if part.HasField("header"):
                header = part.header
                layer_floats = math.prod(header.kv_block_shape[1:]) // header.kv_block_shape[2]  # float32
                layers = LayerAssembler(LayerLayout.layer_major(header.num_layers, 4 * layer_floats), len(header.prompt_token_ids), BLOCK) \
                    if header.num_layers else None
            elif part.HasField("layer"):
                layers.feed(WireChunk(meta=part.layer.meta, data=part.layer.data, last=part.layer.last))
            elif part.HasField("block"):
                blobs.append(part.block.data)  # one chunk per block here: blocks are < 1 MB
        assert header is not None
        self.blocks[header.request_id] = [bytes(b) for b in layers.payloads()] if layers is not None else blobs
        return decode_pb2.HandoffReply(accepted=True)

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    scheduler, decode = SchedulerStandIn(), RecordingDecode()
    process = DecodeProcess(tmp_path_factory.mktemp("batching"), scheduler.address, 64 * BLOCK, role="prefill",
                            extra={"max_batch_tokens": 1024})
    try:
        process.start()
        yield process, decode
    finally:
        process.stop()
        decode.stop()
        scheduler.stop()


def prefill(process: DecodeProcess, decode: RecordingDecode, request_id: str, prompt: list[int],
            salt: bytes) -> prefill_pb2.FirstToken:
    with grpc.insecure_channel(process.address) as channel:
        events = list(prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
            request_id=request_id, token_ids=prompt, cache_salt=salt, decode_address=decode.address,
            sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)), timeout=120))
    assert [e.WhichOneof("event") for e in events] == ["first_token", "handed_off"], request_id
    return events[0].first_token


def forwards(process: DecodeProcess) -> tuple[float, float]:
    """(prefill forwards, prompts in them) so far."""
    return (process.metric("crescent_engine_batch_size_count", role="prefill"),
            process.metric("crescent_engine_batch_size_sum", role="prefill"))


def test_concurrent_prompts_share_forwards_and_answer_as_when_alone(servers) -> None:
    process, decode = servers
    answers: dict[str, prefill_pb2.FirstToken] = {}

    # Batched: the base prompt first (its blocks are the hits), then every prompt at once.
    prefill(process, decode, "together-base", BASE, b"together")
    before = forwards(process)
    callers = [threading.Thread(target=lambda i=i, p=p: answers.update(
        {f"together-{i}": prefill(process, decode, f"together-{i}", p, b"together")})) for i, p in enumerate(PROMPTS)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(120)
    together = [a - b for a, b in zip(forwards(process), before)]
    assert len(answers) == len(PROMPTS)
    assert together[1] == len(PROMPTS) and together[0] < len(PROMPTS), f"forwards, prompts: {together}"

    # Alone: the same hits and misses under another salt, one prompt at a time.
    prefill(process, decode, "alone-base", BASE, b"alone")
    before = forwards(process)
    for i, p in enumerate(PROMPTS):
        answers[f"alone-{i}"] = prefill(process, decode, f"alone-{i}", p, b"alone")
    alone = [a - b for a, b in zip(forwards(process), before)]
    assert alone == [len(PROMPTS), len(PROMPTS)], "one prompt per forward when they come one by one"

    for i, p in enumerate(PROMPTS):
        got, want = answers[f"together-{i}"], answers[f"alone-{i}"]
        assert got.token_id == want.token_id, f"prompt {i}: first token"
        assert got.cached_tokens == want.cached_tokens == {0: 4 * BLOCK, 3: 5 * BLOCK}.get(i, 0), f"prompt {i}"
        got_kv, want_kv = decode.blocks[f"together-{i}"], decode.blocks[f"alone-{i}"]
        assert len(got_kv) == -(-len(p) // BLOCK)
        assert got_kv == want_kv, f"prompt {i}: the KV handed to decode"
