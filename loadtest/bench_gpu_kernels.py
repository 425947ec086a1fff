"""Kernel figures on one GPU: KDA prefill against fla-core's ``chunk_kda``, MLA paged decode,
MoE grouped matmul and MXFP4 matmul, each as a fraction of the device's peak.

Every case is also checked against an independent result (fla-core's kernel, or a plain PyTorch
computation of the same product) so a fast wrong kernel cannot pass. Prints a table, then one
JSON line (the last line of stdout); exits 1 when a case errs or disagrees with its check.

    python loadtest/bench_gpu_kernels.py [--json out.json] [--repeats 10]
    python loadtest/bench_gpu_kernels.py --dry-run    # no GPU: Triton's CPU interpreter, tiny fp32
                                                      # shapes; checks the plumbing, times nothing real

Shapes are K3-like (docs/k3.md): KDA head dim 128; MLA latent 512 + RoPE 64, 16 heads (one
tensor-parallel shard's worth rounded to the kernel's head tile); MoE latent 3584 → 2×3072;
MXFP4 weights 6144×3584. Bandwidth counts each byte the kernel must move once (inputs read,
outputs written); timings flush the L2 cache before each call, as triton's do_bench does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_peaks beside this file
from gpu_peaks import peaks_for  # noqa: E402

KDA_NOMINAL_CHUNK = 64  # FLOPs are counted for a 64-token chunkwise form, whatever chunk a kernel uses


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny fp32 shapes")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per case (median reported)")
    ap.add_argument("--json", type=Path, help="also write the JSON result here")
    ap.add_argument("--only", default="kda,mla,moe,mxfp4", help="comma-separated kernels to run")
    return ap.parse_args(argv)


class Bench:
    """Device, dtype, timing and peak bookkeeping shared by every case."""

    def __init__(self, torch, dry_run: bool, repeats: int) -> None:
        self.torch = torch
        self.dry_run = dry_run
        self.device = "cpu" if dry_run else "cuda"
        self.dtype = torch.float32 if dry_run else torch.bfloat16
        self.repeats = 1 if dry_run else repeats
        self.name = "cpu-interpreter" if dry_run else torch.cuda.get_device_name()
        peak = None if dry_run else peaks_for(self.name)
        self.peak_tflops, self.peak_gbs = peak if peak else (None, None)
        self.tol = 2e-3 if dry_run else 2e-2  # fp32 under the interpreter; bf16 outputs on a GPU
        # writing 256 MB evicts the 50-60 MB L2 of a Hopper part between timed calls
        self._flush = None if dry_run else torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def rnd(self, *shape):
        return self.torch.randn(*shape, device=self.device).to(self.dtype)

    def time(self, fn: Callable[[], object]) -> float:
        """Median seconds of one call, after a warm-up call that compiles and autotunes."""
        torch = self.torch
        fn()
        times = []
        for _ in range(self.repeats):
            if self.dry_run:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
                continue
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2]

    def rates(self, seconds: float, flops: float, nbytes: float) -> dict:
        """TFLOP/s and GB/s of one call, with their fractions of the device's peaks."""
        tflops, gbs = flops / seconds / 1e12, nbytes / seconds / 1e9
        return {
            "ms": round(seconds * 1e3, 4),
            "tflops": round(tflops, 3),
            "gbs": round(gbs, 1),
            "frac_peak_tflops": round(tflops / self.peak_tflops, 4) if self.peak_tflops else None,
            "frac_peak_gbs": round(gbs / self.peak_gbs, 4) if self.peak_gbs else None,
        }

    def check(self, row: dict, err: float) -> dict:
        row["rel_rms_vs_check"] = float(f"{err:.3g}")
        row["ok"] = bool(err < self.tol)
        return row


def rel_rms(a, b) -> float:
    """Relative RMS difference of a from b, computed on a's device."""
    a, b = a.double(), b.to(a.device).double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


# --- KDA -------------------------------------------------------------------------------------

def load_fla(dry_run: bool) -> tuple[Callable | None, str]:
    """fla-core's chunk_kda when it can run here, and a note saying what was compared."""
    try:
        import fla
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError as exc:
        return None, f"fla-core not importable ({exc}); KDA checked against crescent's fp32 reference"
    version = getattr(fla, "__version__", "?")
    if dry_run:
        return None, f"fla-core {version} found, but its kernels autotune and need a GPU; KDA checked against crescent's fp32 reference"
    return fla_chunk_kda, f"fla-core {version} chunk_kda"


def kda_cases(b: Bench, fla_chunk_kda: Callable | None) -> list[dict]:
    torch = b.torch
    from crescent.kernels.kda import chunk_kda, chunk_kda_reference, kda_gate

    if b.dry_run:
        shapes = [("1x64 h2 d32", [64], 2, 32), ("varlen 40+24 h2 d32", [40, 24], 2, 32)]
    else:
        shapes = [("1x8192 h16", [8192], 16, 128), ("1x32768 h16", [32768], 16, 128),
                  ("varlen 8k+2k+1k+5k h32", [8192, 2048, 1024, 5120], 32, 128)]
    rows = []
    for label, lens, h, d in shapes:
        t = sum(lens)
        q, k, v = b.rnd(1, t, h, d), b.rnd(1, t, h, d), b.rnd(1, t, h, d)
        g = kda_gate(torch.randn(1, t, h, d), torch.randn(h) * 0.5, torch.randn(h * d)).to(b.device)
        beta = torch.rand(1, t, h, device=b.device).to(b.dtype)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=b.device) if len(lens) > 1 else None
        ours = lambda: chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)  # noqa: E731
        seconds = b.time(ours)
        o, _ = ours()
        c = KDA_NOMINAL_CHUNK
        flops = t * h * (2 * c * (2 * d + d) + 6 * d * d)
        nbytes = sum(x.numel() * x.element_size() for x in (q, k, v, g, beta, o)) + len(lens) * h * d * d * 4
        row = {"case": label, "tokens": t, "heads": h, "head_dim": d, **b.rates(seconds, flops, nbytes),
               "tokens_per_s": round(t / seconds)}
        if fla_chunk_kda is not None:
            theirs = lambda: fla_chunk_kda(  # noqa: E731
                q=q, k=k, v=v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
            fla_seconds = b.time(theirs)
            o_ref = theirs()[0]
            row["fla_ms"] = round(fla_seconds * 1e3, 4)
            row["speedup_vs_fla"] = round(fla_seconds / seconds, 3)  # >= 1: ours at least as fast
        else:  # the reference is a CPU loop over chunks, in fp32
            o_ref, _ = chunk_kda_reference(*(x.cpu().float() for x in (q, k, v, g, beta)),
                                           cu_seqlens=None if cu is None else cu.cpu())
        rows.append(b.check(row, rel_rms(o, o_ref)))
    return rows


# --- MLA paged decode --------------------------------------------------------------------------

def mla_cases(b: Bench) -> list[dict]:
    torch = b.torch
    from crescent.kernels.mla import mla_paged_attention

    if b.dry_run:
        h, dc, dr, page, ctx, batches = 4, 32, 16, 16, 48, (1, 2)
    else:
        h, dc, dr, page, ctx, batches = 16, 512, 64, 64, 8192, (1, 32, 128)
    scale = (128 + dr) ** -0.5  # K3: nope 128 + rope 64
    rows = []
    for n in batches:
        pages_per_seq = -(-ctx // page)
        cache = b.rnd(n * pages_per_seq, page, dc + dr)
        # shuffled pages, as a long-running cache hands them out
        table = torch.randperm(n * pages_per_seq, device=b.device).view(n, pages_per_seq).to(torch.int32)
        seq_lens = torch.full((n,), ctx, dtype=torch.int32, device=b.device)
        cu_q = torch.arange(n + 1, dtype=torch.int32, device=b.device)
        q_lat, q_rope = b.rnd(n, h, dc), b.rnd(n, h, dr)
        run = lambda: mla_paged_attention(q_lat, q_rope, cache, table, seq_lens, cu_q, scale=scale)  # noqa: E731
        seconds = b.time(run)
        out = run()
        elem = cache.element_size()
        nbytes = n * ctx * (dc + dr) * elem + (q_lat.numel() + q_rope.numel() + out.numel()) * elem + table.numel() * 4
        flops = n * h * ctx * 2 * (dc + dr + dc)  # scores over Dc+Dr, then the weighted sum over Dc
        # check the first sequence against plain attention over its gathered latents
        lat = cache[table[0].long()].reshape(-1, dc + dr)[:ctx].float()
        scores = (q_lat[0].float() @ lat[:, :dc].T + q_rope[0].float() @ lat[:, dc:].T) * scale
        ref = scores.softmax(-1) @ lat[:, :dc]
        row = {"case": f"batch {n} x ctx {ctx}", "batch": n, "context": ctx, "heads": h, **b.rates(seconds, flops, nbytes)}
        rows.append(b.check(row, rel_rms(out[0].float(), ref)))
    return rows


# --- MoE grouped matmul ------------------------------------------------------------------------

def moe_cases(b: Bench) -> list[dict]:
    torch = b.torch
    from crescent.kernels.moe import grouped_matmul

    if b.dry_run:
        experts, k, n, shapes = 4, 64, 32, [("prefill 12 tok x top2", 12, 2), ("decode 2 tok x top2", 2, 2)]
    else:
        experts, k, n = 32, 3584, 6144
        shapes = [("prefill 2048 tok x top8", 2048, 8), ("decode 32 tok x top8", 32, 8)]
    w = b.rnd(experts, k, n) * k ** -0.5
    rows = []
    for label, tokens, top_k in shapes:
        m = tokens * top_k
        ids = torch.randint(0, experts, (m,), device=b.device)
        sizes = torch.bincount(ids, minlength=experts)
        offsets = torch.zeros(experts + 1, dtype=torch.int64, device=b.device)
        offsets[1:] = sizes.cumsum(0)
        x = b.rnd(m, k)
        run = lambda: grouped_matmul(x, w, offsets)  # noqa: E731
        seconds = b.time(run)
        out = run()
        used = int((sizes > 0).sum())
        elem = x.element_size()
        nbytes = (x.numel() + out.numel() + used * k * n) * elem  # only the experts that got rows are read
        ref = torch.cat([x[a:e].float() @ w[i].float() for i, (a, e) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))])
        row = {"case": label, "rows": m, "experts": experts, "k": k, "n": n, **b.rates(seconds, 2 * m * k * n, nbytes)}
        rows.append(b.check(row, rel_rms(out.float(), ref)))
    return rows


# --- MXFP4 matmul ------------------------------------------------------------------------------

def mxfp4_cases(b: Bench) -> list[dict]:
    torch = b.torch
    from crescent.kernels.mxfp4 import dequantize_mxfp4, mxfp4_matmul, quantize_mxfp4

    n, k, ms = (32, 64, (1, 8)) if b.dry_run else (6144, 3584, (1, 32, 2048))
    blocks, scales = quantize_mxfp4(torch.randn(n, k))  # packing is load-time CPU work
    w = dequantize_mxfp4(blocks, scales).to(b.device)  # [N, K] fp32, the check's weight
    blocks, scales = blocks.to(b.device), scales.to(b.device)
    rows = []
    for m in ms:
        x = b.rnd(m, k)
        run = lambda: mxfp4_matmul(x, blocks, scales)  # noqa: E731
        seconds = b.time(run)
        out = run()
        nbytes = blocks.numel() + scales.numel() + (x.numel() + out.numel()) * x.element_size()
        row = {"case": f"M {m} x {n}x{k}", "m": m, "n": n, "k": k, **b.rates(seconds, 2 * m * n * k, nbytes)}
        rows.append(b.check(row, rel_rms(out.float(), x.float() @ w.T)))
    return rows


def print_rows(kernel: str, rows: list[dict]) -> None:
    for row in rows:
        extra = f"  vs fla x{row['speedup_vs_fla']}" if "speedup_vs_fla" in row else ""
        status = "ok" if row.get("ok") else f"FAIL {row.get('error', 'check')}"
        print(f"{kernel:>6} {row['case']:<28} {row.get('ms', '-'):>10} ms {row.get('tflops', '-'):>9} TFLOP/s "
              f"{row.get('gbs', '-'):>8} GB/s  peak {row.get('frac_peak_tflops')}/{row.get('frac_peak_gbs')}"
              f"{extra}  {status}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
    import torch
    import triton

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU plumbing check", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    if args.dry_run:
        torch.set_num_threads(1)
    b = Bench(torch, args.dry_run, args.repeats)
    fla_chunk_kda, fla_note = load_fla(args.dry_run)
    result = {
        "bench": "gpu_kernels", "dry_run": args.dry_run, "device": b.name,
        "peak_bf16_tflops": b.peak_tflops, "peak_hbm_gbs": b.peak_gbs,
        "torch": torch.__version__, "triton": triton.__version__, "dtype": str(b.dtype).removeprefix("torch."),
        "kda_compared_with": fla_note, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    cases = {"kda": lambda: kda_cases(b, fla_chunk_kda), "mla": lambda: mla_cases(b),
             "moe": lambda: moe_cases(b), "mxfp4": lambda: mxfp4_cases(b)}
    wanted = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(cases))
    if unknown:
        print(f"--only: unknown kernels {unknown}; choose from {sorted(cases)}", file=sys.stderr)
        return 2
    print(f"device: {b.name}  peaks: {b.peak_tflops} TFLOP/s bf16, {b.peak_gbs} GB/s  |  {fla_note}", flush=True)
    for name in wanted:
        try:
            result[name] = cases[name]()
        except Exception as exc:  # noqa: BLE001 - one broken kernel must not hide the others' figures
            result[name] = [{"case": "all", "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}]
        print_rows(name, result[name])
        if args.json:  # what is done so far survives a stage timeout
            args.json.write_text(json.dumps({**result, "complete": False}) + "\n")
    kda_speedups = [row["speedup_vs_fla"] for row in result.get("kda", []) if "speedup_vs_fla" in row]
    # the figure: KDA prefill at least as fast as fla-core's chunk_kda on the same shapes
    result["kda_prefill_ge_fla"] = min(kda_speedups) >= 1.0 if kda_speedups else None
    result["ok"] = all(row.get("ok") for name in wanted for row in result[name])
    result["complete"] = True
    line = json.dumps(result)
    if args.json:
        args.json.write_text(line + "\n")
    print(line)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
