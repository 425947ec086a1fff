"""Triton RMSNorm, one program per row, the row's sum of squares in one fixed order.

The row is streamed in BLOCK_D chunks (BLOCK_D depends on D only, never on the number of rows)
into a per-lane fp32 accumulator that one ``tl.sum`` folds at the end: the same order for a row
whatever the batch. Output ``x * rsqrt(mean(x^2) + eps) * weight``, the CPU op's formula.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def invariant_rms_norm_kernel(x, weight, out, D, stride_x, stride_o, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        v = tl.load(x + row * stride_x + d0 + offs, mask=d0 + offs < D, other=0.0).to(tl.float32)
        acc += v * v
    inv = tl.rsqrt(tl.sum(acc, 0) / D + eps)
    for d0 in range(0, D, BLOCK_D):
        m = d0 + offs < D
        v = tl.load(x + row * stride_x + d0 + offs, mask=m, other=0.0).to(tl.float32)
        wv = tl.load(weight + d0 + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out + row * stride_o + d0 + offs, (v * inv * wv).to(out.dtype.element_ty), mask=m)
