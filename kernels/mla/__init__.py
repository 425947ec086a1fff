"""Gated MLA: attention over a paged latent cache (absorbed projections), plus reference pieces.

    q_lat        [Tq, H, Dc]   absorbed queries, W_uk_h q_nope_h (see :func:`absorb_query`)
    q_rope       [Tq, H, Dr]   RoPE part of the queries
    cache        [P, S, Dc+Dr] paged latent cache: c_kv then k_rope per slot, S = block size
    block_table  [N, max_pages] int32/int64 page ids of each sequence, in order
    seq_lens     [N]           tokens in the cache per sequence, *including* this step's queries
    cu_q         [N + 1]       cumulative query counts; sequence i's queries are its last tokens
    ->           o_lat [Tq, H, Dc] (query dtype); then :func:`expand_output` (W_uv) and
                 :func:`apply_output_gate` (sigmoid gate) give the gated head outputs.

Decode is ``cu_q = arange(N + 1)``; a prefill chunk after a cached prefix writes its latents to
the cache first (:func:`write_latent_cache`) and queries with its own tokens. Dc, Dr and S must
be powers of two (K3: Dc = 512, Dr = 64). Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton

from crescent.kernels import _triton
from crescent.kernels._triton import check_device, check_float, check_pow2
from crescent.kernels.mla.paged_attention import mla_paged_attention_kernel
from crescent.kernels.mla.reference import (
    absorb_query,
    apply_output_gate,
    expand_output,
    mla_attention_reference,
    write_latent_cache,
)

__all__ = [
    "mla_paged_attention",
    "absorb_query",
    "expand_output",
    "apply_output_gate",
    "write_latent_cache",
    "mla_attention_reference",
]

HEAD_TILE = 16


def mla_paged_attention(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Causal latent attention for every query token over its sequence's pages; see module doc.

    ``scale`` is the softmax scale of the un-absorbed heads, 1/sqrt(Dn + Dr).
    """
    for name, t in (("q_lat", q_lat), ("q_rope", q_rope)):
        check_float(name, t)
    if cache.dtype != torch.float8_e4m3fn:  # an fp8 latent cache is read as it is (its scale is the caller's)
        check_float("cache", cache)
    if q_lat.dim() != 3 or q_rope.dim() != 3 or cache.dim() != 3:
        raise ValueError("q_lat, q_rope must be [Tq, H, D] and cache [pages, block_size, Dc + Dr]")
    tq, h, dc = q_lat.shape
    dr = q_rope.shape[2]
    if q_rope.shape[:2] != (tq, h) or cache.shape[2] != dc + dr:
        raise ValueError(f"q_rope must be [{tq}, {h}, Dr] and cache's last dim Dc + Dr = {dc + dr}")
    check_pow2("Dc", dc, 16, 1024)
    check_pow2("Dr", dr, 16, 256)
    check_pow2("block size", cache.shape[1], 16, 1024)
    n = seq_lens.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != n or cu_q.shape != (n + 1,):
        raise ValueError(f"block_table must be [{n}, max_pages] and cu_q [{n + 1}] for {n} sequences")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens), ("cu_q", cu_q)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64, got {t.dtype}")
    check_device(q_lat, q_rope, cache, block_table, seq_lens, cu_q)
    out = _triton.alloc((tq, h, dc), dtype=q_lat.dtype, device=q_lat.device)
    if tq == 0:
        return out
    counts = cu_q[1:] - cu_q[:-1]
    seq_of_q = torch.repeat_interleave(torch.arange(n, device=cu_q.device), counts, output_size=tq)
    grid = (tq, triton.cdiv(h, HEAD_TILE))
    mla_paged_attention_kernel[grid](
        q_lat.contiguous(), q_rope.contiguous(), cache, block_table.contiguous(), seq_lens, cu_q, seq_of_q, out,
        float(scale), h, block_table.shape[1],
        DC=dc, DR=dr, BH=HEAD_TILE, PAGE=cache.shape[1],
        PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
    )
    return out
