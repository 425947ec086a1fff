"""Triton ``x @ W^T (+ b)`` whose every output row is summed in one fixed order.

A row's result must not depend on how many rows share the launch (see ``crescent.kernels.cpu.ops``
for why: disaggregated serving promises a single-process run's tokens). Three things would break
that and none is done here: a tile shape chosen by M (autotuning on M picks other MMA shapes and
K steps), split-K (partial sums added in an order that depends on the grid), and atomics. One
fixed (BLOCK_M, BLOCK_N, BLOCK_K) serves every M; each program walks K from 0 in BLOCK_K steps
and accumulates in fp32, so row i's bits are the same in a batch of 1, 3 or 1000.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def invariant_linear_kernel(
    x, w, bias, out,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m_rows = rows < M
    m_cols = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        m_k = k0 + ks < K
        # masked tails load zeros: x * 0 adds exactly nothing, so K's tail is no special case
        a = tl.load(x + rows[:, None] * stride_xm + (k0 + ks)[None, :] * stride_xk,
                    mask=m_rows[:, None] & m_k[None, :], other=0.0)
        b = tl.load(w + cols[None, :] * stride_wn + (k0 + ks)[:, None] * stride_wk,
                    mask=m_cols[None, :] & m_k[:, None], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong; bf16 products are exact in fp32 anyway
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=m_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rows[:, None] * stride_om + cols[None, :] * stride_on, acc.to(out.dtype.element_ty),
             mask=m_rows[:, None] & m_cols[None, :])
