"""Loading time and resident bytes of an MXFP4 kimi_k3 checkpoint: experts packed vs dequantized.

Writes a Crescent-format checkpoint (routed experts and other projections in MXFP4) of a
K3-shaped model scaled down, then loads it once per mode, each in a fresh process: load seconds,
bytes of the routed experts as the model holds them, bytes of every weight tensor, how much the
process's resident memory grew while loading, the time of one 128-token prefill and the median
decode step, and the prefill's logits to compare the modes (they must be equal bit for bit).

    python loadtest/bench_mxfp4_load.py [--experts 64] [--hidden 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels import triton; no kernel runs on CPU here

import torch  # noqa: E402

from crescent.kernels.mxfp4 import Mxfp4Tensor  # noqa: E402
from crescent.services.engine.kimi_k3.config import NANO  # noqa: E402


def bench_config(experts: int, hidden: int):
    return dataclasses.replace(
        NANO, vocab_size=4096, hidden_size=hidden, num_experts=experts, num_experts_per_tok=4,
        moe_latent_size=hidden // 2, moe_intermediate_size=hidden, shared_intermediate_size=hidden,
        dense_intermediate_size=2 * hidden, kda_gate_rank=32, kv_lora_rank=64,
    )


def tensor_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes of every tensor reachable from ``obj`` (attributes, lists, dicts), each storage once."""
    seen = set() if seen is None else seen
    if isinstance(obj, Mxfp4Tensor):
        return tensor_bytes(obj.blocks, seen) + tensor_bytes(obj.scales, seen)
    if isinstance(obj, torch.Tensor):
        if obj.is_mkldnn:
            return obj.numel() * obj.element_size()  # an opaque prepacked copy: count its elements
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return 0
    seen.add(id(obj))
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return sum(tensor_bytes(v, seen) for v in obj)
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names += [s for s in getattr(cls, "__slots__", ()) if isinstance(s, str)]
    return sum(tensor_bytes(getattr(obj, n, None), seen) for n in names if not n.startswith("__"))


def load_once(path: str, mode: str) -> dict:
    """One mode, in this (fresh) process."""
    from crescent.services.engine.engine import Engine
    from crescent.services.engine.kimi_k3.ffn import LatentMoe
    from crescent.services.engine.kimi_k3.loading import load_k3_model
    from crescent.services.model.model_source import resolve_model

    torch.set_num_threads(1)
    rss_before = current_rss()
    start = time.perf_counter()
    model = load_k3_model(resolve_model(path), mxfp4_experts=mode)
    seconds = time.perf_counter() - start
    rss_loaded = current_rss() - rss_before
    experts = [w for f in model.ffn if isinstance(f, LatentMoe) for w in f.experts]
    params = sum(math.prod(w.shape) for w in experts)
    expert_bytes = tensor_bytes(experts)
    engine = Engine(model, model_id="bench", kv_capacity_tokens=256, block_size=64)
    seq = engine.add_sequence("a", list(range(1, 129)))
    start = time.perf_counter()
    logits = engine.prefill(seq)
    prefill_s = time.perf_counter() - start
    steps = []
    for _ in range(7):  # the median step: the first ones pay one-off set-up
        seq.token_ids.append(int(logits.argmax()))
        start = time.perf_counter()
        engine.decode_step([seq])
        steps.append(time.perf_counter() - start)
    decode_s = sorted(steps)[len(steps) // 2]
    return {"mode": mode, "load_s": round(seconds, 3), "expert_params": params, "expert_bytes": expert_bytes,
            "expert_bits_per_weight": round(expert_bytes * 8 / params, 3), "weight_bytes": tensor_bytes(model),
            "rss_growth_bytes": rss_loaded, "prefill_128_s": round(prefill_s, 3), "decode_step_s": round(decode_s, 4), "logits_sha256": hashlib.sha256(logits.numpy().tobytes()).hexdigest()}


def current_rss() -> int:
    """Resident bytes of this process now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--load-one", nargs=2, metavar=("DIR", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_one:
        print(json.dumps(load_once(*args.load_one)))
        return
    from crescent.services.engine.kimi_k3.loading import save_hf_dir, seeded_weights

    cfg = bench_config(args.experts, args.hidden)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_dir(Path(tmp), cfg, seeded_weights(cfg, 0), dtype=torch.float32, mxfp4=True)
        disk = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        rows = []
        for mode in ("packed", "dequantize"):
            out = subprocess.run([sys.executable, __file__, "--load-one", tmp, mode], capture_output=True,
                                 text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"checkpoint: {cfg.num_layers} layers, {cfg.num_experts} experts of {cfg.moe_latent_size}x"
          f"{cfg.moe_intermediate_size}, {disk / 1e6:.1f} MB of safetensors")
    for r in rows:
        print(f"{r['mode']:>10}: load {r['load_s']:.2f} s, experts {r['expert_bytes'] / 1e6:.2f} MB "
              f"({r['expert_bits_per_weight']} bits/weight), all weights {r['weight_bytes'] / 1e6:.1f} MB, "
              f"RSS grew {r['rss_growth_bytes'] / 1e6:.0f} MB while loading; prefill of 128 tokens "
              f"{r['prefill_128_s']:.2f} s, a decode step {r['decode_step_s'] * 1e3:.0f} ms")
    same = rows[0]["logits_sha256"] == rows[1]["logits_sha256"]
    print(f"prefill logits equal bit for bit: {same}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "logits_equal": same, "disk_bytes": disk}, indent=1))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
