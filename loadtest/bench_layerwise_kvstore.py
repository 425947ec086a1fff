#!/usr/bin/env python
"""Layer-wise kvstore export on and off (issue 16, item 3), real prefill and kvstore processes.

    .venv/bin/python loadtest/bench_layerwise_kvstore.py [--tokens 2048 8064] [--rounds 3] [--model kimi-k3-nano]

Starts a kvstore node (host tier, shared memory) and two prefill processes writing to it
(``layerwise_kvstore`` on and off), with a stand-in scheduler, all on 127.0.0.1 with the default
model (SmolLM2-135M, float32; or ``--model``, e.g. the hybrid ``kimi-k3-nano``, whose MLA latents
go a layer at a time and whose KDA state snapshots once final: ``layerwise_store.py``) and
one torch thread each. Each round sends, to each prefill in
turn (which one first alternates), the same cold prompt of random tokens (a fresh cache salt)
with ``max_tokens`` 1 and no decode: the kvstore export alone is measured. ``--with-handoff``
adds a decode process and sends ``max_tokens`` 2 to it, so the layer-wise handoff (on in both
prefills) streams beside the export, as by default. ``--no-shared-memory``: the prefills reach
the node over its TCP side channel, as from another pod (the export then goes chunk by chunk). The node's blocks are removed after each
prompt, so every export finds the same empty node.

From the prefill's metrics, per prompt: the prefill time (``step_seconds``), the time from the
prompt computed to its new blocks stored in the node (``to_kvstore_exposed``: off, the whole
export; on, the last layer's copies and the last chunk's commit), and the bytes written into
the node before the prompt's last layer was computed (``to_kvstore_hidden`` of ``to_kvstore``).
Prints medians over rounds and the share of the export hidden behind compute:
1 - exposed(on) / exposed(off).

``--overhead``: what the export costs the compute, without prefill processes: the same prompt's
``Engine.prefill`` in this process, alone and with a ``LayerwiseStoreExport`` writing every
layer into a real node's pool on the event loop's thread, alternated; prints the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from crescent.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the real-process fixtures of tests/
from crescent.services.kvstore.client import KvStoreClient  # noqa: E402
from tests.decode.process import BLOCK, DecodeProcess, SchedulerStandIn  # noqa: E402
from tests.kvstore.conftest import Node, start_node  # noqa: E402

VOCAB = 49152  # the default model's (SmolLM2-135M)
KIMI_VOCAB = 163840  # the kimi_k3 presets' (the Kimi tokenizer's id space)
BYTES, SECONDS = "crescent_engine_kv_transfer_bytes_total", "crescent_engine_kv_transfer_seconds"


def prompt(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def snapshot(prefill: DecodeProcess) -> dict[str, float]:
    return {
        "prefill_s": prefill.metric("crescent_engine_step_seconds_sum", role="prefill"),
        "exposed_s": prefill.metric(SECONDS + "_sum", direction="to_kvstore_exposed"),
        "exports": prefill.metric(SECONDS + "_count", direction="to_kvstore_exposed"),
        "stored_bytes": prefill.metric(BYTES, direction="to_kvstore"),
        "early_bytes": prefill.metric(BYTES, direction="to_kvstore_hidden"),
    }


def empty(node: Node) -> None:
    """Remove every block the node holds (the next export starts from the same empty node)."""
    async def main() -> None:
        client = KvStoreClient(node.address)
        try:
            listed = await client.list_blocks(limit=100_000)
            if listed is not None and listed.blocks:
                await client.remove([b.key for b in listed.blocks])
        finally:
            await client.close()
    asyncio.run(main())


def one_prompt(prefill: DecodeProcess, node: Node, request_id: str, tokens: list[int],
               decode: DecodeProcess | None = None) -> dict[str, float]:
    """One cold prompt (handed to ``decode`` if given), its export waited for; the metric deltas
    it caused, and its TTFT."""
    before = snapshot(prefill)
    start = time.perf_counter()
    ttft = 0.0
    sampling = common_pb2.SamplingParams(max_tokens=2 if decode else 1, ignore_eos=True)
    with grpc.insecure_channel(prefill.address) as channel:
        for event in prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id=request_id, token_ids=tokens, cache_salt=request_id.encode(), sampling=sampling,
                decode_address=decode.address if decode else ""), timeout=600):
            if event.WhichOneof("event") == "first_token":
                ttft = time.perf_counter() - start
    if decode is not None:
        with grpc.insecure_channel(decode.address) as channel:
            for _ in decode_pb2_grpc.DecodeStub(channel).StreamTokens(decode_pb2.StreamRequest(request_id=request_id), timeout=120):
                pass
    deadline = time.monotonic() + 120
    while snapshot(prefill)["exports"] == before["exports"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = snapshot(prefill)
    empty(node)
    return {k: after[k] - before[k] for k in after} | {"ttft_s": ttft}


def overhead(tokens: int, rounds: int) -> None:
    from crescent.services.engine.engine import Engine
    from crescent.services.engine.llama import LlamaModel
    from crescent.services.engine.loader import load_model
    from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model
    from crescent.services.prefill.layerwise_store import LayerwiseStoreExport

    torch.set_num_threads(1)
    loaded = load_model(resolve_model(DEFAULT_MODEL), progress=False)
    engine = Engine(LlamaModel(loaded.config, loaded.weights), model_id=loaded.model_id,
                    kv_capacity_tokens=tokens + BLOCK, block_size=BLOCK)

    async def once(node: Node, streamed: bool, seed: int) -> float:
        seq = engine.add_sequence(f"s{seed}", prompt(tokens, seed), use_cache=False)
        client = KvStoreClient(node.address, shared_memory=True)
        try:
            start = time.perf_counter()
            if not streamed:
                await asyncio.to_thread(engine.prefill, seq)
                return time.perf_counter() - start
            layered = LayerwiseStoreExport(engine, seq, 0, client)
            tasks: list[asyncio.Task] = []
            layered.start(lambda coro: tasks.append(asyncio.create_task(coro)))
            await asyncio.to_thread(engine.prefill, seq, layered.on_layer)
            elapsed = time.perf_counter() - start
            assert await layered.finished() == [] and layered.stored == len(seq.block_keys)
            await asyncio.gather(*tasks)
            return elapsed
        finally:
            engine.release(seq)
            await client.close()

    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        node = start_node({"tiers": {"host": {"capacity_bytes": 1 << 30}}}, Path(tmp), "kvstore")
        try:
            for r in range(rounds):
                for streamed in ((False, True) if r % 2 == 0 else (True, False)):
                    times[streamed].append(asyncio.run(once(node, streamed, r)))
                    empty(node)
        finally:
            node.stop()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{tokens} tokens, 1 torch thread, load {os.getloadavg()[0]:.2f}, median of {rounds}: prefill alone {off:.2f} s, "
          f"exporting layer-wise {on:.2f} s ({on / off - 1:+.1%}); rounds alone "
          f"{' '.join(f'{t:.2f}' for t in times[False])}, exporting {' '.join(f'{t:.2f}' for t in times[True])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8064], help="prompt lengths (< 8192, the context)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--with-handoff", action="store_true", help="hand each prompt to a decode process too")
    parser.add_argument("--overhead", action="store_true", help="in-process: the compute's cost of the export")
    parser.add_argument("--no-shared-memory", action="store_true",
                        help="prefill reaches the node over the TCP side channel (as from another pod): chunk by chunk")
    parser.add_argument("--model", default="", help="a preset other than the default (e.g. kimi-k3-nano)")
    args = parser.parse_args()
    if args.overhead and args.model:
        parser.error("--overhead measures the default model only")
    if args.overhead:
        for n in args.tokens:
            overhead(n, args.rounds)
        return

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped by ``timeout``: stop the processes too
    os.environ["OMP_NUM_THREADS"] = "1"
    capacity = max(args.tokens) + 2 * BLOCK
    vocab = KIMI_VOCAB if args.model.startswith("kimi") else VOCAB
    engine = {"engine": {"model": args.model, "kv_capacity_tokens": capacity, "block_size": BLOCK, "threads": 1}} if args.model else {}
    scheduler = SchedulerStandIn()
    processes: dict[str, DecodeProcess] = {}
    node: Node | None = None
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            node = start_node({"tiers": {"host": {"capacity_bytes": 1 << 30}}}, Path(tmp), "kvstore")
            if args.with_handoff:
                (Path(tmp) / "decode").mkdir()
                processes["decode"] = DecodeProcess(Path(tmp) / "decode", scheduler.address, capacity, extra=engine)
                processes["decode"].start()
            decode = processes.get("decode")
            for mode in ("on", "off"):
                run_dir = Path(tmp) / mode
                run_dir.mkdir()
                processes[mode] = DecodeProcess(run_dir, scheduler.address, capacity, role="prefill",
                                                extra={"kvstore_address": node.address, "layerwise_kvstore": mode == "on",
                                                       "kvstore_shared_memory": not args.no_shared_memory, **engine})
                processes[mode].start()
            for mode in ("on", "off"):  # warm-up
                one_prompt(processes[mode], node, f"warm-{mode}", prompt(512, 0, vocab), decode)
            for r in range(args.rounds):
                for n in args.tokens:
                    tokens = prompt(n, 1000 * r + n, vocab)
                    for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                        results.setdefault((n, mode), []).append(
                            one_prompt(processes[mode], node, f"r{r}-{n}-{mode}", tokens, decode))
        finally:
            for process in processes.values():
                process.stop()
            if node is not None:
                node.stop()
            scheduler.stop()

    load = os.getloadavg()
    print(f"{args.model or 'default model'}, float32, 1 torch thread per process, {os.cpu_count()} cores, load {load[0]:.2f} "
          f"{load[1]:.2f}; median of {args.rounds} rounds{'; with the layer-wise handoff to decode' if decode else ''}"
          f"{'; over the TCP side channel' if args.no_shared_memory else ''}")
    print(f"{'tokens':>6} {'KV MB':>6} {'prefill s':>9} {'export off s':>12} {'exposed on s':>12} {'hidden':>7}"
          f" {'bytes early':>11} {'TTFT off':>8} {'TTFT on':>7}  exposed on / off per round")
    for n in args.tokens:
        off, on = results[(n, "off")], results[(n, "on")]

        def med(rows: list[dict[str, float]], key: str) -> float:
            return statistics.median(row[key] for row in rows)

        before, after = med(off, "exposed_s"), med(on, "exposed_s")
        early = statistics.median(row["early_bytes"] / row["stored_bytes"] for row in on)
        rounds = " ".join(f"{a['exposed_s']:.3f}/{b['exposed_s']:.3f}" for a, b in zip(on, off))
        print(f"{n:>6} {med(on, 'stored_bytes') / 1e6:6.1f} {med(off, 'prefill_s'):9.2f} {before:12.3f} {after:12.3f}"
              f" {1 - after / before:7.0%} {early:11.0%} {med(off, 'ttft_s'):8.2f} {med(on, 'ttft_s'):7.2f}  {rounds}")


if __name__ == "__main__":
    main()
