"""Triton Block AttnRes mix: one program per token, D streamed in chunks (D may be 7168).

Pass 1 reads each source once for its sum of squares and its dot with w * gamma, giving
logit_n = <w * gamma, v_n> / rms(v_n); pass 2 reads the sources again for sum_n a_n v_n.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_attn_res_kernel(
    src, qw, out, N, T, D, eps,
    BN: tl.constexpr, BD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    logits = tl.full([BN], float("-inf"), dtype=tl.float32)
    for n in range(0, N):
        base = src + (n * T + row) * D
        ss = tl.zeros([BD], dtype=tl.float32)
        dot = tl.zeros([BD], dtype=tl.float32)
        for d0 in range(0, D, BD):
            m = d0 + o_d < D
            v = tl.load(base + d0 + o_d, mask=m, other=0.0).to(tl.float32)
            w = tl.load(qw + d0 + o_d, mask=m, other=0.0)
            ss += v * v
            dot += v * w
        logit = tl.sum(dot, 0) * tl.rsqrt(tl.sum(ss, 0) / D + eps)
        logits = tl.where(o_n == n, logit, logits)
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)
    for d0 in range(0, D, BD):
        m = d0 + o_d < D
        acc = tl.zeros([BD], dtype=tl.float32)
        for n in range(0, N):
            a = tl.sum(tl.where(o_n == n, p, 0.0), 0)
            acc += a * tl.load(src + (n * T + row) * D + d0 + o_d, mask=m, other=0.0).to(tl.float32)
        tl.store(out + row * D + d0 + o_d, acc.to(out.dtype.element_ty), mask=m)
