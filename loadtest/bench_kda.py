"""KDA prefill/decode timings: Crescent's Triton kernels vs fla-core's chunk_kda/fused_recurrent_kda.

On a GPU it times K3-like shapes (head dim 128) in bf16 inputs with fp32 states. Without CUDA
it says so, switches Triton to its CPU interpreter and runs one tiny fp32 shape: a smoke run of
the script and of the agreement check, not a performance figure.

    python loadtest/bench_kda.py [--seq-len 8192] [--heads 16] [--batch 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any kernel import

from crescent.kernels.kda import chunk_kda, kda_decode, kda_gate, l2_normalize  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds per call after one warm-up (compilation) call."""
    fn()
    times = []
    for _ in range(repeats):
        if GPU:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if GPU:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", help="write the figures here as well")
    args = ap.parse_args()
    torch.manual_seed(0)
    if GPU:
        device, dtype = "cuda", torch.bfloat16
        b, t, h, d, nd = args.batch, args.seq_len, args.heads, args.head_dim, args.decode_batch
        print(f"GPU: {torch.cuda.get_device_name()}")
    else:
        torch.set_num_threads(2)
        device, dtype = "cpu", torch.float32
        b, t, h, d, nd, args.repeats = 1, 64, 2, 32, 4, 1
        print("No CUDA: Triton interpreter, tiny fp32 shape; timings are not performance figures.")
    fla_chunk = fla_recurrent = None
    try:
        from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_recurrent
        from fla.ops.kda.naive import naive_recurrent_kda
    except ImportError:
        print("fla-core not installed: timing Crescent's kernels only")
    if not GPU and fla_chunk is not None:
        # fla's kernels autotune, which needs a GPU driver; on CPU check against its naive loop
        fla_chunk = fla_recurrent = None
        print("fla-core kernels autotune and need a GPU: comparing with fla's naive reference only")

    def rnd(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    q, k, v = rnd(b, t, h, d), rnd(b, t, h, d), rnd(b, t, h, d)
    g = kda_gate(torch.randn(b, t, h, d), torch.randn(h) * 0.5, torch.randn(h * d)).to(device)
    beta = torch.rand(b, t, h, device=device).to(dtype)
    results = {"device": torch.cuda.get_device_name() if GPU else "cpu-interpreter",
               "shape": {"batch": b, "seq_len": t, "heads": h, "head_dim": d, "dtype": str(dtype)}}

    ours = lambda: chunk_kda(q, k, v, g, beta, output_final_state=True)  # noqa: E731
    results["prefill_s"] = timed(ours, args.repeats)
    o, s = ours()
    if fla_chunk is not None:
        theirs = lambda: fla_chunk(  # noqa: E731
            q=q, k=k, v=v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        results["fla_prefill_s"] = timed(theirs, args.repeats)
        o_fla, s_fla = theirs()
        results["prefill_rel_rms_vs_fla"] = rel_rms(o.float(), o_fla.float())
    elif "naive_recurrent_kda" in locals():
        o_naive, _ = naive_recurrent_kda(q=l2_normalize(q), k=l2_normalize(k), v=v, g=g, beta=beta)
        results["prefill_rel_rms_vs_fla_naive"] = rel_rms(o.float(), o_naive.float())

    state = torch.randn(nd, h, d, d, device=device)
    dq, dk_, dv = rnd(nd, h, d), rnd(nd, h, d), rnd(nd, h, d)
    dg = g[0, :1].expand(nd, h, d).contiguous()
    dbeta = beta[0, :1].expand(nd, h).contiguous()
    results["decode_step_s"] = timed(lambda: kda_decode(dq, dk_, dv, dg, dbeta, state.clone()), args.repeats)
    if fla_recurrent is not None:
        def fla_step():
            return fla_recurrent(
                q=dq[:, None], k=dk_[:, None], v=dv[:, None], g=dg[:, None], beta=dbeta[:, None],
                initial_state=state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
            )
        results["fla_decode_step_s"] = timed(fla_step, args.repeats)
    results["prefill_tokens_per_s"] = b * t / results["prefill_s"]
    for key, val in results.items():
        print(f"{key:>30}: {val}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
