"""Triton grouped matmul: rows sorted by expert, each expert's rows times that expert's weight.

Program (tile, n) finds its expert from ``tile_offsets`` (cumulative row tiles per expert,
computed on the device): the grid is an upper bound, cdiv(M, BM) + E tiles, so the host never
waits for the group sizes, and programs past the last real tile return at once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_matmul_kernel(
    x, w, out, group_offsets, tile_offsets,
    E, N, KD,
    BE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    i_n = tl.program_id(1)
    if pid >= tl.load(tile_offsets + E):
        return
    o_e = tl.arange(0, BE)
    tiles_through = tl.load(tile_offsets + 1 + o_e, mask=o_e < E, other=2147483647)
    i_e = tl.sum((tiles_through <= pid).to(tl.int32), 0)  # experts whose tiles all precede pid
    i_m = pid - tl.load(tile_offsets + i_e)
    start = tl.load(group_offsets + i_e).to(tl.int64)
    end = tl.load(group_offsets + i_e + 1).to(tl.int64)
    rows = start + i_m * BM + tl.arange(0, BM)
    cols = i_n * BN + tl.arange(0, BN)
    m_r = rows < end
    m_c = cols < N
    w_e = w + i_e.to(tl.int64) * KD * N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, KD, BK):
        ks = k0 + tl.arange(0, BK)
        m_k = ks < KD
        a = tl.load(x + rows[:, None] * KD + ks[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0)
        b = tl.load(w_e + ks[:, None] * N + cols[None, :], mask=m_k[:, None] & m_c[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    tl.store(out + rows[:, None] * N + cols[None, :], acc.to(out.dtype.element_ty), mask=m_r[:, None] & m_c[None, :])
