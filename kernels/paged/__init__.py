"""Paged attention over Crescent's KV pool in Triton: decode and varlen (chunked) prefill.

    q             [N, H, D] (decode: one query per sequence) or [T, H, D] (prefill)
    k_pool/v_pool [P, S, KV, D]  one layer's keys / values, e.g. ``cache.pool[:, layer, 0]`` and
                  ``[:, layer, 1]`` of the engine's (pages, layers, 2, S, KV, D) pool: strided
                  views are fine (any strides), S = block size (a multiple of 16; 64 by default)
    block_tables  [N, max_pages] int32/int64: sequence i's pages in order (entries past its
                  length are never read)
    seq_lens      [N] int32/int64: tokens of sequence i in the pool, *including* this step's
                  queries (whose K and V are written first), each >= its query count and >= 1
    cu_q          [N + 1] (prefill only): cumulative query counts; sequence i's queries are
                  q[cu_q[i]:cu_q[i+1]], its last tokens, each attending causally to its prefix
    ->            [N or T, H, D] in q's dtype

GQA: H a multiple of KV (query head h reads KV head h // (H / KV)). D <= 256 (any size, padded
to a power of two in registers). Pools float32, float16 or bfloat16 (K and V alike), q any of
them; softmax and accumulation in fp32; float32 pools use IEEE fp32 dots, others TF32 on a GPU
(exact for 16-bit pool values). A row's result depends on its own sequence only, in a fixed
order (``attention.py``): batch-invariant, and a prefill query's bits do not depend on how its
prompt was chunked. Decode cuts long contexts into fixed 512-key pieces merged in order. No host sync (the prefill grid is sized from T and N). Runs on CUDA, or on
CPU under ``TRITON_INTERPRET=1``; the engine's CPU path stays ``crescent.kernels.cpu``.
"""

from __future__ import annotations

import torch
import triton

from crescent.kernels import _triton
from crescent.kernels._triton import check_device, check_float
from crescent.kernels.paged.attention import (
    paged_decode_combine_kernel,
    paged_decode_kernel,
    paged_decode_split_kernel,
    paged_prefill_kernel,
)
from crescent.kernels.paged.reference import paged_attention_reference

__all__ = ["paged_decode_attention", "paged_prefill_attention", "paged_attention_reference"]

QUERY_BLOCK = 32    # prefill queries per program
MAX_TILE = 64       # keys per step (the largest power of two dividing the block size, capped here)
DECODE_SPLIT = 512  # decode keys per program once a table can reach past this (a multiple of the tile)


def paged_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, *, scale: float,
) -> torch.Tensor:
    """Attention of each sequence's one new query over its pages; shapes in the module doc."""
    n, h, d = _check(q, k_pool, v_pool, block_tables, seq_lens)
    if q.shape[0] != n:
        raise ValueError(f"decode takes one query per sequence: q has {q.shape[0]} rows for {n} sequences")
    q, block_tables = _unit_last_stride(q), block_tables.contiguous()
    out = _triton.alloc((n, h, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    kv, page = k_pool.shape[2], k_pool.shape[1]
    group = h // kv
    tile = _tile(page, d)
    meta = dict(TILE=tile, PAGE=page, BG=max(16, triton.next_power_of_2(group)), BD=_bd(d),
                PRECISION=_precision(q, k_pool))
    # Long contexts are cut into fixed SPLIT-key pieces (more programs than N x KV for a small batch
    # of long sequences), merged in order. The cut depends on positions only, and a row of one
    # piece gets the unsplit kernel's bits, so which path a batch takes never changes a row.
    split = max(tile, DECODE_SPLIT // tile * tile)
    splits = triton.cdiv(block_tables.shape[1] * page, split)  # from shapes: no host sync
    if splits <= 1:
        paged_decode_kernel[(n, kv)](
            q, k_pool, v_pool, block_tables, seq_lens, out, float(scale), h, d, group,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), *k_pool.stride(),
            **meta,
        )
        return out
    part_o = _triton.alloc((n, h, splits, d), dtype=torch.float32, device=q.device)
    part_ml = _triton.alloc((n, h, splits, 2), dtype=torch.float32, device=q.device)
    paged_decode_split_kernel[(n, kv, splits)](
        q, k_pool, v_pool, block_tables, seq_lens, part_o, part_ml, float(scale), h, d, group, splits,
        q.stride(0), q.stride(1), block_tables.stride(0), *k_pool.stride(),
        SPLIT=split, **meta,
    )
    paged_decode_combine_kernel[(n, h)](
        part_o, part_ml, seq_lens, out, h, d, splits, out.stride(0), out.stride(1), SPLIT=split, BD=meta["BD"],
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, cu_q: torch.Tensor, *, scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's chunk of queries over its cached prefix and itself.

    Any number of queries per sequence (1 included), so a mixed prefill/decode batch is one call;
    shapes in the module doc.
    """
    n, h, d = _check(q, k_pool, v_pool, block_tables, seq_lens)
    if cu_q.shape != (n + 1,) or cu_q.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_q must be [{n + 1}] int32/int64, got {tuple(cu_q.shape)} {cu_q.dtype}")
    check_device(cu_q)
    q, block_tables = _unit_last_stride(q), block_tables.contiguous()
    t = q.shape[0]
    out = _triton.alloc((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0 or n == 0:
        return out
    # Program b serves sequence seq_of_block[b]; sized T/QUERY_BLOCK + N so no count leaves the device.
    blocks = (cu_q[1:] - cu_q[:-1] + QUERY_BLOCK - 1) // QUERY_BLOCK
    ends = torch.cumsum(blocks, 0)
    grid_blocks = triton.cdiv(t, QUERY_BLOCK) + n
    seq_of_block = torch.searchsorted(ends, torch.arange(grid_blocks, device=q.device, dtype=ends.dtype), right=True)
    paged_prefill_kernel[(grid_blocks, h)](
        q, k_pool, v_pool, block_tables, seq_lens, cu_q, seq_of_block, ends - blocks, out, float(scale),
        n, d, h // k_pool.shape[2],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *k_pool.stride(),
        BQ=QUERY_BLOCK, TILE=_tile(k_pool.shape[1], d), PAGE=k_pool.shape[1], BD=_bd(d),
        PRECISION=_precision(q, k_pool),
    )
    return out


def _check(q, k_pool, v_pool, block_tables, seq_lens) -> tuple[int, int, int]:
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        check_float(name, t)
    if q.dim() != 3 or k_pool.dim() != 4:
        raise ValueError("q must be [tokens, H, D] and k_pool, v_pool [pages, block_size, KV, D]")
    if v_pool.shape != k_pool.shape or v_pool.stride() != k_pool.stride() or v_pool.dtype != k_pool.dtype:
        raise ValueError("k_pool and v_pool must have one shape, dtype and strides (two views of one pool)")
    _, h, d = q.shape
    _, block_size, kv, pool_d = k_pool.shape
    if pool_d != d or kv == 0 or h % kv:
        raise ValueError(f"q [*, {h}, {d}] does not fit pools of {kv} KV heads of dim {pool_d} (H % KV == 0)")
    if d > 256 or block_size % 16:
        raise ValueError(f"head dim {d} must be <= 256 and block size {block_size} a multiple of 16")
    n = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if n < 0 or block_tables.dim() != 2 or block_tables.shape[0] != n:
        raise ValueError(f"seq_lens must be [N] and block_tables [N, max_pages], got {tuple(seq_lens.shape)} "
                         f"and {tuple(block_tables.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64, got {t.dtype}")
    check_device(q, k_pool, v_pool, block_tables, seq_lens)
    return n, h, d


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _tile(block_size: int, d: int) -> int:
    """Keys per step: the largest power of two dividing the block size, at most MAX_TILE, halved
    for head dims over 128 so a step's fp32 K and V tiles stay within 64 KiB."""
    return min(MAX_TILE, block_size & -block_size, max(16, 8192 // _bd(d)))


def _bd(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _precision(q: torch.Tensor, pool: torch.Tensor) -> str:
    return "ieee" if q.dtype == pool.dtype == torch.float32 else "tf32"
