"""Peak host memory while loading a real-format Kimi checkpoint, against the weights' bytes.

Writes a multi-shard checkpoint in a real Moonshot format (``kimi_linear``: bf16; ``kimi_k3``:
nested config, MXFP4 routed experts), scaled up from the test fixtures
(tests/engine/kimi_real_format.py) so that the weights dwarf the interpreter, then loads it with
``load_k3_model`` in a fresh process and prints:

- ``file_bytes``: the tensors in the shards; ``resident_bytes``: the weights as the model holds
  them (fp32, MXFP4 experts packed) — what loading must at least allocate;
- ``peak_rss_growth``: the process's peak resident set (``VmHWM``, reset by ``/proc/self/clear_refs``
  just before loading) less its resident set before loading: weights, the tensor in flight, the
  mapped shard's pages touched so far; ``retained_rss_growth``: what stays after loading;
- ``peak_anon_growth`` / ``peak_file_growth``: the same split into anonymous memory (the weights,
  the tensor in flight) and file-backed pages (the memory-mapped shards: page cache the kernel
  can drop, counted in RSS while mapped), sampled every millisecond;
- measured on the process's *second* load of the checkpoint (the first thrown away, glibc's
  ``MALLOC_MMAP_THRESHOLD_`` fixed so freed blocks leave the process): a process's first load
  also pays one-time costs (~17 MB: torch's thread pools and op caches) that are no loader's;
- ``peak_ratio`` = peak_rss_growth / resident_bytes, ``peak_anon_ratio`` likewise for anonymous
  memory (the issue's bound: ~1.2), and the peak over the file bytes; ``tracemalloc_peak``: Python-heap allocations during the load (torch's storage
  is not on the Python heap: small by design).

    python loadtest/bench_load_memory.py [--format kimi_linear|kimi_k3] [--hidden 512] [--shards 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels import triton; no kernel runs on CPU here

_CHILD = r"""
import json, os, sys, time, tracemalloc
from pathlib import Path
import torch
torch.set_num_threads(1)
from crescent.kernels.mxfp4 import Mxfp4Tensor
from crescent.services.engine.kimi_k3.loading import load_k3_model
from crescent.services.model.model_source import resolve_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
import gc, threading
source = resolve_model(sys.argv[1])
# one load first, thrown away: the one-time costs of a process's first load (torch's thread pools
# and op caches, lazily built tables: ~17 MB whatever the checkpoint) are not the loader's; with
# MALLOC_MMAP_THRESHOLD_ fixed (the parent sets it) every large block freed here goes back to the OS
del_me = load_k3_model(source, mxfp4_experts="packed")
del del_me
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # peak RSS := current RSS
before, anon_before, file_before = status("VmRSS"), status("RssAnon"), status("RssFile")
peaks = {"anon": anon_before, "file": file_before}
done = threading.Event()
def sample():  # RssAnon / RssFile have no peak counter of their own: sample them every millisecond
    while not done.is_set():
        peaks["anon"] = max(peaks["anon"], status("RssAnon"))
        peaks["file"] = max(peaks["file"], status("RssFile"))
        time.sleep(0.001)
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
tracemalloc.start()
start = time.perf_counter()
model = load_k3_model(source, mxfp4_experts="packed")
seconds = time.perf_counter() - start
_, py_peak = tracemalloc.get_traced_memory()
tracemalloc.stop()
done.set(); sampler.join()
peak, after = status("VmHWM"), status("VmRSS")
seen, resident = set(), 0
def add(t):
    global resident
    if isinstance(t, Mxfp4Tensor):
        add(t.blocks); add(t.scales); return
    if isinstance(t, torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key); resident += t.untyped_storage().nbytes()
def walk(obj, depth=0):
    if depth > 4: return
    if isinstance(obj, (torch.Tensor, Mxfp4Tensor)): add(obj); return
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else (
        [getattr(obj, s) for s in getattr(obj, "__slots__", ())] + list(getattr(obj, "__dict__", {}).values()))
    for v in items: walk(v, depth + 1)
walk(model)
print(json.dumps({"seconds": seconds, "rss_before": before, "peak_rss_growth": peak - before,
                  "peak_anon_growth": peaks["anon"] - anon_before, "peak_file_growth": peaks["file"] - file_before,
                  "retained_anon_growth": status("RssAnon") - anon_before,
                  "retained_rss_growth": after - before, "resident_bytes": resident,
                  "tracemalloc_peak": py_peak}))
"""


def write_checkpoint(root: Path, fmt: str, hidden: int, experts: int, vocab: int, shards: int) -> tuple[Path, int]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.engine helpers
    from tests.engine.kimi_real_format import K3_CONFIG, KIMI_LINEAR_CONFIG, real_tensors, with_changes
    from tests.engine.kimi_real_format import write_checkpoint as write

    base = K3_CONFIG if fmt == "kimi_k3" else KIMI_LINEAR_CONFIG
    heads = max(2, hidden // 64)
    sizes = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_experts": experts,
             "moe_intermediate_size": hidden, "num_attention_heads": heads, "kv_lora_rank": hidden // 4,
             "linear_attn_config": {**(base.get("text_config") or base)["linear_attn_config"], "num_heads": heads,
                                    "head_dim": 64}}
    if fmt == "kimi_k3":
        sizes["routed_expert_hidden_size"] = hidden // 2
        if "q_lora_rank" in base["text_config"]:
            sizes["q_lora_rank"] = hidden // 2
    config = with_changes(base, sizes)
    tensors = real_tensors(config)
    file_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    write(root, config, tensors, shards=shards)
    return root, file_bytes


def measure_load(path: Path) -> dict:
    """Load ``path`` in a fresh process; the figures above (but the file bytes)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *sys.path]), "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=False, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    figures["peak_ratio"] = figures["peak_rss_growth"] / figures["resident_bytes"]
    figures["peak_anon_ratio"] = figures["peak_anon_growth"] / figures["resident_bytes"]
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=("kimi_linear", "kimi_k3"), default="kimi_linear")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, file_bytes = write_checkpoint(Path(tmp) / args.format, args.format, args.hidden, args.experts,
                                            args.vocab, args.shards)
        figures = measure_load(path)
    figures |= {"format": args.format, "shards": args.shards, "file_bytes": file_bytes,
                "peak_over_file_bytes": figures["peak_rss_growth"] / file_bytes}
    for key in ("file_bytes", "resident_bytes", "peak_rss_growth", "peak_anon_growth", "peak_file_growth",
                "retained_rss_growth", "retained_anon_growth", "tracemalloc_peak"):
        print(f"{key:>22}: {figures[key] / 1e6:10.1f} MB")
    print(f"{'peak_ratio':>22}: {figures['peak_ratio']:10.3f}  (peak RSS growth / resident weights; mapped shard pages included)")
    print(f"{'peak_anon_ratio':>22}: {figures['peak_anon_ratio']:10.3f}  (peak anonymous memory growth / resident weights)")
    print(f"{'peak_over_file_bytes':>22}: {figures['peak_over_file_bytes']:10.3f}")
    print(f"{'seconds':>22}: {figures['seconds']:10.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
