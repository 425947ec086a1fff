"""The prefill -> decode handoff of one prompt's KV, before and after the one-codec change.

    .venv/bin/python loadtest/bench_handoff.py [--tokens 2048] [--rounds 5]

A receiver process on 127.0.0.1 serves Decode/Handoff twice: with protobuf's generated
deserializer (how decode read handoffs before) and with ``handoff_wire`` (now); both assemble
the blocks as decode does. The sender copies the prompt's blocks out of a paged cache shaped
like the default model's (SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32, 64-token pages;
46,080 bytes per token) and streams them:

- *before*: each block copied out twice (once for the kvstore export, once for the handoff,
  as prefill did) and sent as generated ``HandoffPart`` messages (protobuf copies the payload
  into the message and out again);
- *after*: each block copied out once (``PromptExport``: shared with the kvstore export) and
  sent through ``handoff_wire`` (one join into the message, a slice on receipt).

Prints the seconds of each (median of rounds), its GB/s, and its share of the prompt's prefill
time (``--prefill-s``: measured here with the default model, 2,048 tokens ≈ 6 s; see
../shared/TOOLING.md and docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
import time

import grpc
import torch

from crescent.protos import common_pb2, decode_pb2
from crescent.services.common.grpc_service import GRPC_OPTIONS
from crescent.services.kvwire.chunk_wire import WireChunk
from crescent.services.kvwire.handoff_wire import decode_part, encode_part, handoff_parts
from crescent.services.kvwire.kv_block import BlockAssembler
from crescent.services.prefill.prompt_export import owned_bytes

PAGE = 64
PAGE_SHAPE = (30, 2, PAGE, 3, 64)  # the default model's KV page, fp32
BEFORE, AFTER = "/bench.Before/Handoff", "/crescent.v1.Decode/Handoff"


# ---- the receiver (its own process) -----------------------------------------------------------

async def _receive(parts, as_wire) -> decode_pb2.HandoffReply:  # noqa: ANN001
    assembler, blocks = BlockAssembler(), 0
    async for part in parts:
        part = as_wire(part)
        if part.block is not None and assembler.feed(part.block) is not None:
            blocks += 1
    return decode_pb2.HandoffReply(accepted=blocks > 0)


def _from_protobuf(part: decode_pb2.HandoffPart):  # noqa: ANN202 - the old decode servicer's view
    if part.HasField("header"):
        return _Part(None)
    c = part.block
    return _Part(WireChunk(meta=c.meta if c.HasField("meta") else None, data=c.data, last=c.last))


class _Part:
    def __init__(self, block: WireChunk | None) -> None:
        self.block = block


async def serve(port_out) -> None:  # noqa: ANN001 - stdout
    server = grpc.aio.server(options=GRPC_OPTIONS)

    async def before(parts, context):  # noqa: ANN001, ANN202
        return await _receive(parts, _from_protobuf)

    async def after(parts, context):  # noqa: ANN001, ANN202
        return await _receive(parts, lambda p: p)

    reply = decode_pb2.HandoffReply.SerializeToString
    handlers = {
        BEFORE: grpc.stream_unary_rpc_method_handler(before, request_deserializer=decode_pb2.HandoffPart.FromString,
                                                     response_serializer=reply),
        AFTER: grpc.stream_unary_rpc_method_handler(after, request_deserializer=decode_part, response_serializer=reply),
    }

    class Generic(grpc.GenericRpcHandler):
        def service(self, details):  # noqa: ANN001, ANN202
            return handlers.get(details.method)

    server.add_generic_rpc_handlers((Generic(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True, file=port_out)
    await server.wait_for_termination()


# ---- the sender -------------------------------------------------------------------------------------

def _header(num_blocks: int, tokens: int) -> decode_pb2.HandoffHeader:
    return decode_pb2.HandoffHeader(request_id="bench", model_id="bench", prompt_token_ids=[1] * tokens,
                                    kv_dtype="float32", kv_block_shape=list(PAGE_SHAPE), num_blocks=num_blocks)


def _meta(i: int, nbytes: int) -> common_pb2.BlockMeta:
    return common_pb2.BlockMeta(key=f"bench/{i}".encode(), model_id="bench", dtype="float32",
                                shape=list(PAGE_SHAPE), nbytes=nbytes, found=True)


async def _before(channel: grpc.aio.Channel, cache: torch.Tensor, tokens: int) -> None:
    blobs = [cache[i].numpy().tobytes() for i in range(cache.shape[0])]  # the handoff's copy
    _kvstore_copies = [cache[i].numpy().tobytes() for i in range(cache.shape[0])]  # the export's copy  # noqa: F841
    parts = [decode_pb2.HandoffPart(header=_header(len(blobs), tokens))]
    parts += [decode_pb2.HandoffPart(block=common_pb2.BlockChunk(meta=_meta(i, len(b)), data=b, last=True))
              for i, b in enumerate(blobs)]
    call = channel.stream_unary(BEFORE, request_serializer=decode_pb2.HandoffPart.SerializeToString,
                                response_deserializer=decode_pb2.HandoffReply.FromString)
    assert (await call(iter(parts), timeout=120)).accepted


async def _after(channel: grpc.aio.Channel, cache: torch.Tensor, tokens: int) -> None:
    payloads = [owned_bytes(cache[i]) for i in range(cache.shape[0])]  # one copy, shared with the export
    parts = handoff_parts(_header(len(payloads), tokens), [(_meta(i, len(p)), p) for i, p in enumerate(payloads)])
    call = channel.stream_unary(AFTER, request_serializer=encode_part,
                                response_deserializer=decode_pb2.HandoffReply.FromString)
    assert (await call(parts, timeout=120)).accepted


def prefill_seconds(tokens: int) -> float | None:
    """A cold prefill of ``tokens`` with the default model here (None if it cannot be loaded)."""
    try:
        from crescent.services.engine.engine import Engine
        from crescent.services.engine.llama import LlamaModel
        from crescent.services.engine.loader import load_model
        from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model
    except ImportError:
        return None
    try:
        loaded = load_model(resolve_model(DEFAULT_MODEL), progress=False)
    except Exception:  # noqa: BLE001 - no model here: the share is left out
        return None
    engine = Engine(LlamaModel(loaded.config, loaded.weights), model_id=loaded.model_id,
                    kv_capacity_tokens=tokens + PAGE, block_size=PAGE)
    seq = engine.add_sequence("bench", [(7 * i) % 1000 + 10 for i in range(tokens)], use_cache=False)
    start = time.perf_counter()
    engine.prefill(seq)
    return time.perf_counter() - start


def measure(tokens: int = 2048, rounds: int = 5, prefill_s: float | None = None) -> dict:
    """Median seconds of the handoff before and after, and their share of the prefill."""
    torch.set_num_threads(2)
    pages = math.ceil(tokens / PAGE)
    cache = torch.randn(pages + 4, *PAGE_SHAPE)[:pages]  # pages of a paged cache (views into one pool)
    nbytes = pages * cache[0].numel() * 4
    receiver = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(receiver.stdout.readline())

        async def run() -> dict[str, list[float]]:
            times: dict[str, list[float]] = {"before": [], "after": []}
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
                for send in (_before, _after):  # warm the channel
                    await send(channel, cache[:1], PAGE)
                for r in range(rounds):
                    for name, send in (("before", _before), ("after", _after))[:: 1 if r % 2 == 0 else -1]:
                        start = time.perf_counter()
                        await send(channel, cache, tokens)
                        times[name].append(time.perf_counter() - start)
            return times

        times = asyncio.run(run())
    finally:
        receiver.kill()
        receiver.wait()
    prefill = prefill_s if prefill_s is not None else prefill_seconds(tokens)
    out: dict = {"tokens": tokens, "kv_mib": round(nbytes / 2**20, 1), "rounds": rounds,
                 "prefill_s": round(prefill, 3) if prefill else None}
    for name, seconds in times.items():
        median = statistics.median(seconds)
        out[f"{name}_s"] = round(median, 4)
        out[f"{name}_gbps"] = round(nbytes / median / 1e9, 3)
        if prefill:
            out[f"{name}_pct_of_prefill"] = round(100 * median / prefill, 2)
    print(f"handoff of a {tokens}-token prompt ({out['kv_mib']} MiB of KV): before {out['before_s'] * 1000:.1f} ms "
          f"({out['before_gbps']} GB/s), after {out['after_s'] * 1000:.1f} ms ({out['after_gbps']} GB/s)"
          + (f"; {out['before_pct_of_prefill']}% -> {out['after_pct_of_prefill']}% of its {prefill:.2f} s prefill"
             if prefill else ""), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefill-s", type=float, default=None, help="prefill seconds to compare with (default: measure)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(sys.stdout))
        return
    print(json.dumps({"bench": "handoff", **measure(args.tokens, args.rounds, args.prefill_s)}))


if __name__ == "__main__":
    main()
