"""Triton fused recurrent KDA: the update rule token by token, state kept in registers.

Used for decode (one token per sequence, state read and written in place, optionally through
a state-slot index) and for short runs where a chunked launch does not pay off.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kda_recurrent_fwd_kernel(
    q, k, v, g, beta, o, h0, ht, cu_seqlens, state_idx,
    scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    USE_STATE_IDX: tl.constexpr,
):
    i_nh = tl.program_id(0)  # N * HV may exceed the 65535 limit of grid axes 1 and 2
    i_v = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    if USE_STATE_IDX:
        i_slot = tl.load(state_idx + i_n).to(tl.int64)
    else:
        i_slot = i_n.to(tl.int64)

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_state = (i_slot * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]

    b_s = tl.zeros([K, BV], dtype=tl.float32)
    if USE_H0:
        b_s += tl.load(h0 + p_state, mask=m_v[None, :], other=0.0).to(tl.float32)

    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k).to(tl.float32)
        b_g = tl.load(g + (t * HV + i_hv) * K + o_k).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + t * HV + i_hv).to(tl.float32)
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6) * scale
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)

        b_s = b_s * tl.exp(b_g)[:, None]
        b_err = (b_v - tl.sum(b_k[:, None] * b_s, 0)) * b_beta
        b_s += b_k[:, None] * b_err[None, :]
        b_o = tl.sum(b_q[:, None] * b_s, 0)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)

    if STORE_HT:
        tl.store(ht + p_state, b_s, mask=m_v[None, :])
