#!/usr/bin/env python
"""Layer-wise handoff on and off (issue 16, item 3), between real prefill and decode processes.

    .venv/bin/python loadtest/bench_layerwise.py [--tokens 2048 8064] [--rounds 3] [--model kimi-k3-nano]

Starts two prefill processes (``layerwise_handoff`` on and off), one decode process and a
stand-in scheduler on 127.0.0.1, all with the default model (SmolLM2-135M, float32; or
``--model``, e.g. the hybrid ``kimi-k3-nano``, whose MLA latents go a layer at a time and whose
KDA state goes once final) and one torch thread each. Each round sends, to each prefill in turn, a cold prompt of random tokens
(a fresh cache salt: no prefix hit) with ``max_tokens`` 2, handed to the decode process; the
decode stream is read to its end so the next round starts from an empty decode.

From the prefill's metrics, per prompt: the prefill time (``step_seconds``: the forwards and the
first token's sampling), the handoff time the request waits for after its first token
(``handoff_exposed``: off, the whole handoff; on, what is left of it: the last slices, the
tail with the first tokens and decode's reply), and
the bytes sent before the last layer was computed (``handoff_hidden``). Prints medians over
rounds and the share of the handoff hidden behind compute: 1 - exposed(on) / handoff(off).

``--movers``: the layer-wise handoff's three byte movers side by side (``docs/prefill.md``, "Layer-wise
handoff"): four prefill processes, layer-wise through shared memory (``shm_handoff`` on, the
default), over decode's TCP side channel (``shm_handoff`` off, ``tcp_handoff`` on: what a prefill
in another pod does), over gRPC bytes (both off) and whole (the baseline the share hidden is
measured against). Adds per prompt the CPU seconds of the prefill and of the decode
process (``/proc/<pid>/stat``: user + system, every thread), and the bytes each mover carried.
Each cold prompt is then sent again to the same prefill with the same cache salt ("warm"): its
blocks are in prefill's cache, so all its layers are ready at once and the request is mostly
the handoff itself — what each mover costs in time and CPU, with little compute around it.

``--overhead``: what streaming costs the compute, without processes or sockets: the same
prompt's ``Engine.prefill`` in this process, alone and with a ``LayerwiseHandoff`` copying and
encoding every layer's slices on the event loop's thread as it does in prefill (the parts go
nowhere), alternated; prints the medians.
"""

from __future__ import annotations

import argparse
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
from tests.decode.process import BLOCK, DecodeProcess, SchedulerStandIn  # noqa: E402

VOCAB = 49152  # the default model's (SmolLM2-135M)
KIMI_VOCAB = 163840  # the kimi_k3 presets' (the Kimi tokenizer's id space)
METRIC_BYTES, METRIC_SECONDS = "crescent_engine_kv_transfer_bytes_total", "crescent_engine_kv_transfer_seconds_sum"


def prompt(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(10, vocab - 16, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def snapshot(prefill: DecodeProcess) -> dict[str, float]:
    return {
        "prefill_s": prefill.metric("crescent_engine_step_seconds_sum", role="prefill"),
        "exposed_s": prefill.metric(METRIC_SECONDS, direction="handoff_exposed"),
        "out_bytes": prefill.metric(METRIC_BYTES, direction="handoff_out"),
        "hidden_bytes": prefill.metric(METRIC_BYTES, direction="handoff_hidden"),
    }


def cpu_seconds(process: DecodeProcess) -> float:
    """User + system CPU seconds of a process so far (all its threads)."""
    assert process.proc is not None
    fields = Path(f"/proc/{process.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def one_prompt(prefill: DecodeProcess, decode: DecodeProcess, request_id: str, tokens: list[int],
               salt: str = "") -> dict[str, float]:
    """Send one prompt through prefill to decode; the metric deltas it caused, its TTFT and the
    CPU seconds both processes spent on it."""
    before = snapshot(prefill) | {"prefill_cpu_s": cpu_seconds(prefill), "decode_cpu_s": cpu_seconds(decode)}
    start = time.perf_counter()
    ttft = 0.0
    with grpc.insecure_channel(prefill.address) as channel:
        for event in prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id=request_id, token_ids=tokens, cache_salt=(salt or request_id).encode(), decode_address=decode.address,
                sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True)), timeout=600):
            if event.WhichOneof("event") == "first_token":
                ttft = time.perf_counter() - start
    with grpc.insecure_channel(decode.address) as channel:
        for _ in decode_pb2_grpc.DecodeStub(channel).StreamTokens(decode_pb2.StreamRequest(request_id=request_id), timeout=120):
            pass
    after = snapshot(prefill) | {"prefill_cpu_s": cpu_seconds(prefill), "decode_cpu_s": cpu_seconds(decode)}
    return {k: after[k] - before[k] for k in after} | {"ttft_s": ttft}


def overhead(tokens: int, rounds: int) -> None:
    import asyncio

    from crescent.services.engine.engine import Engine
    from crescent.services.engine.llama import LlamaModel
    from crescent.services.engine.loader import load_model
    from crescent.services.kvwire.handoff_wire import encode_part
    from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model
    from crescent.services.prefill.layerwise import LayerwiseHandoff
    from crescent.services.prefill.prompt_export import PromptExport

    torch.set_num_threads(1)
    loaded = load_model(resolve_model(DEFAULT_MODEL), progress=False)
    engine = Engine(LlamaModel(loaded.config, loaded.weights), model_id=loaded.model_id,
                    kv_capacity_tokens=tokens + BLOCK, block_size=BLOCK)

    async def once(streamed: bool, seed: int) -> float:
        seq = engine.add_sequence(f"s{seed}", prompt(tokens, seed), use_cache=False)
        try:
            start = time.perf_counter()
            if not streamed:
                await asyncio.to_thread(engine.prefill, seq)
                return time.perf_counter() - start
            handoff = LayerwiseHandoff(engine, seq, PromptExport(engine, None, seq, tokens),
                                       decode_pb2.HandoffHeader(request_id="o"))

            async def call(parts):  # noqa: ANN001 - encoded as gRPC would, then dropped
                async for part in parts:
                    encode_part(part)

            handoff.start(call)
            await asyncio.to_thread(engine.prefill, seq, handoff.on_layer)
            elapsed = time.perf_counter() - start
            await handoff.finish([1], [])
            return elapsed
        finally:
            engine.release(seq)

    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for streamed in ((False, True) if r % 2 == 0 else (True, False)):
            times[streamed].append(asyncio.run(once(streamed, r)))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{tokens} tokens, 1 torch thread, load {os.getloadavg()[0]:.2f}, median of {rounds}: prefill alone {off:.2f} s, "
          f"streaming layer-wise {on:.2f} s ({on / off - 1:+.1%}); rounds alone "
          f"{' '.join(f'{t:.2f}' for t in times[False])}, streamed {' '.join(f'{t:.2f}' for t in times[True])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8064], help="prompt lengths (< 8192, the context)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--overhead", action="store_true", help="in-process: the compute's cost of streaming")
    parser.add_argument("--movers", action="store_true", help="layer-wise through shared memory vs TCP vs gRPC bytes")
    parser.add_argument("--model", default="", help="a preset other than the default (e.g. kimi-k3-nano)")
    args = parser.parse_args()
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
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            prefills = MOVERS if args.movers else {"on": {"layerwise_handoff": True}, "off": {"layerwise_handoff": False}}
            for name, extra in [("decode", {}), *prefills.items()]:
                run_dir = Path(tmp) / name
                run_dir.mkdir()
                role = "decode" if name == "decode" else "prefill"
                processes[name] = DecodeProcess(run_dir, scheduler.address, capacity, role=role, extra={**extra, **engine})
                processes[name].start()
            decode = processes["decode"]
            modes = list(prefills)
            for mode in modes:  # warm-up
                one_prompt(processes[mode], decode, f"warm-{mode}", prompt(256, 0, vocab))
            for r in range(args.rounds):
                for n in args.tokens:
                    tokens = prompt(n, 1000 * r + n, vocab)
                    for mode in (modes if r % 2 == 0 else modes[::-1]):  # alternate who goes first
                        results.setdefault((n, mode), []).append(
                            one_prompt(processes[mode], decode, f"r{r}-{n}-{mode}", tokens))
                        if args.movers:  # the same prompt again: its KV is in prefill's cache
                            results.setdefault((n, f"{mode}-warm"), []).append(
                                one_prompt(processes[mode], decode, f"r{r}-{n}-{mode}-warm", tokens, f"r{r}-{n}-{mode}"))
            counts = {m: {mv: processes[m].metric("crescent_handoff_total", mover=mv) for mv in ("shm", "tcp", "grpc")}
                      for m in modes}
        finally:
            for process in processes.values():
                process.stop()
            scheduler.stop()

    if args.movers:
        movers_table(args, results)
        print("handoffs by mover, per prefill process:", counts)
        return
    load = os.getloadavg()
    print(f"{args.model or 'default model'}, float32, 1 torch thread per process, {os.cpu_count()} cores, load {load[0]:.2f} "
          f"{load[1]:.2f}; median of {args.rounds} rounds")
    print(f"{'tokens':>6} {'KV MB':>6} {'prefill s':>9} {'handoff off s':>13} {'exposed on s':>12} {'hidden':>7}"
          f" {'bytes early':>11} {'TTFT off':>8} {'TTFT on':>7}  exposed on / off per round")
    for n in args.tokens:
        off, on = results[(n, "off")], results[(n, "on")]

        def med(rows: list[dict[str, float]], key: str) -> float:
            return statistics.median(row[key] for row in rows)

        before, after = med(off, "exposed_s"), med(on, "exposed_s")
        early = statistics.median(row["hidden_bytes"] / row["out_bytes"] for row in on)
        rounds = " ".join(f"{a['exposed_s']:.3f}/{b['exposed_s']:.3f}" for a, b in zip(on, off))
        print(f"{n:>6} {med(on, 'out_bytes') / 1e6:6.1f} {med(off, 'prefill_s'):9.2f} {before:13.3f} {after:12.3f}"
              f" {1 - after / before:7.0%} {early:11.0%} {med(off, 'ttft_s'):8.2f} {med(on, 'ttft_s'):7.2f}  {rounds}")


MOVERS = {  # --movers: the prefill processes
    "shm": {"layerwise_handoff": True, "shm_handoff": True},
    "tcp": {"layerwise_handoff": True, "shm_handoff": False, "tcp_handoff": True},
    "grpc": {"layerwise_handoff": True, "shm_handoff": False, "tcp_handoff": False},
    "off": {"layerwise_handoff": False},
}


def movers_table(args: argparse.Namespace, results: dict[tuple[int, str], list[dict[str, float]]]) -> None:
    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    load = os.getloadavg()
    print(f"{args.model or 'default model'}, float32, 1 torch thread per process, {os.cpu_count()} cores, load {load[0]:.2f} "
          f"{load[1]:.2f}; median of {args.rounds} rounds")
    print(f"{'tokens':>6} {'mover':>5} {'KV MB':>6} {'prefill s':>9} {'TTFT s':>7} {'exposed ms':>10} {'hidden':>7}"
          f" {'early':>6} {'prefill CPU s':>13} {'decode CPU s':>12}")
    for n in args.tokens:
        whole = med(results[(n, "off")], "exposed_s")
        for mode in MOVERS:
            rows = results[(n, mode)]
            exposed = med(rows, "exposed_s")
            early = statistics.median(row["hidden_bytes"] / row["out_bytes"] for row in rows)
            print(f"{n:>6} {mode:>5} {med(rows, 'out_bytes') / 1e6:6.1f} {med(rows, 'prefill_s'):9.2f} {med(rows, 'ttft_s'):7.2f}"
                  f" {exposed * 1e3:10.1f} {1 - exposed / whole:7.0%} {early:6.0%} {med(rows, 'prefill_cpu_s'):13.2f}"
                  f" {med(rows, 'decode_cpu_s'):12.3f}")
    print("warm (the prompt's KV in prefill's cache: the request is mostly its handoff)")
    print(f"{'tokens':>6} {'mover':>5} {'TTFT s':>7} {'exposed ms':>10} {'prefill CPU s':>13} {'decode CPU s':>12}")
    for n in args.tokens:
        for mode in MOVERS:
            rows = results[(n, f"{mode}-warm")]
            print(f"{n:>6} {mode:>5} {med(rows, 'ttft_s'):7.3f} {med(rows, 'exposed_s') * 1e3:10.1f}"
                  f" {med(rows, 'prefill_cpu_s'):13.2f} {med(rows, 'decode_cpu_s'):12.3f}")


if __name__ == "__main__":
    main()
