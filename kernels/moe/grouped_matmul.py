"""Triton grouped matmul: rows sorted by expert, each expert's rows times that expert's weight.

Program (e, m, n) computes tile m of expert e's rows against column tile n. The grid covers
the worst case (all rows on one expert) so the host never waits for the group sizes; tiles past
an expert's last row return at once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_matmul_kernel(
    x, w, out, group_offsets,
    N, KD,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    i_e = tl.program_id(0)
    i_m = tl.program_id(1)
    i_n = tl.program_id(2)
    start = tl.load(group_offsets + i_e).to(tl.int64)
    end = tl.load(group_offsets + i_e + 1).to(tl.int64)
    row0 = start + i_m * BM
    if row0 >= end:
        return
    rows = row0 + tl.arange(0, BM)
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
