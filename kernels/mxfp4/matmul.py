"""Triton MXFP4 dequantize + matmul: y = x W^T with W read as packed E2M1 codes and E8M0 scales.

Each K step covers one 32-element block: 16 bytes per output row are unpacked into two nibbles,
decoded arithmetically (sign, 2-bit exponent, 1-bit mantissa), scaled by 2^(scale - 127) and
fed to tl.dot, so W never exists in full precision in memory. A scale byte of 0xFF is NaN
(OCP MX spec), so a block carrying it poisons the outputs it touches rather than reading as inf.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mxfp4_matmul_kernel(
    x, blocks, scales, out, M, N, KD,
    BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    rows = i_m * BM + tl.arange(0, BM)
    cols = i_n * BN + tl.arange(0, BN)
    m_r = rows < M
    m_c = cols < N
    o_byte = tl.arange(0, 16)
    o_k = tl.arange(0, 32)
    nb = KD // 32
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i_b in range(0, nb):
        p_bytes = (cols[:, None].to(tl.int64) * nb + i_b) * 16 + o_byte[None, :]
        b = tl.load(blocks + p_bytes, mask=m_c[:, None], other=0).to(tl.int32)
        codes = tl.reshape(tl.join(b & 15, b >> 4), (BN, 32))  # low nibble first
        sign = tl.where((codes & 8) != 0, -1.0, 1.0)
        e = (codes >> 1) & 3
        man = (codes & 1).to(tl.float32)
        mag = tl.where(e == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((e - 1).to(tl.float32)))
        s = tl.load(scales + cols.to(tl.int64) * nb + i_b, mask=m_c, other=127).to(tl.float32)
        # E8M0 0xFF = NaN; the clamp keeps the untaken branch finite (2^128 would overflow)
        factor = tl.where(s == 255.0, float("nan"), tl.exp2(tl.minimum(s, 254.0) - 127.0))
        w = sign * mag * factor[:, None]
        a = tl.load(x + rows[:, None] * KD + i_b * 32 + o_k[None, :], mask=m_r[:, None], other=0.0)
        acc += tl.dot(a.to(tl.float32), tl.trans(w), input_precision=PRECISION)
    tl.store(out + rows[:, None] * N + cols[None, :], acc.to(out.dtype.element_ty), mask=m_r[:, None] & m_c[None, :])
