"""Triton MLA attention in absorbed form over the paged latent cache.

One program per (query token, tile of heads): the heads of a token share every page they read,
so a page of latents is loaded once per tile. Online softmax over the sequence's pages; query
at absolute position p sees cache positions <= p, which serves decode (one query per sequence)
and chunked prefill on top of a cached prefix (the chunk's tokens already written to the cache).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mla_paged_attention_kernel(
    q_lat, q_rope, cache, block_table, seq_lens, cu_q, seq_of_q, out,
    scale, H, max_pages,
    DC: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_q = tl.program_id(0).to(tl.int64)
    i_hb = tl.program_id(1)
    i_n = tl.load(seq_of_q + i_q).to(tl.int64)
    q_start = tl.load(cu_q + i_n).to(tl.int64)
    q_end = tl.load(cu_q + i_n + 1).to(tl.int64)
    seq_len = tl.load(seq_lens + i_n).to(tl.int64)
    pos = seq_len - (q_end - q_start) + (i_q - q_start)

    heads = i_hb * BH + tl.arange(0, BH)
    m_h = heads < H
    o_c = tl.arange(0, DC)
    o_r = tl.arange(0, DR)
    o_s = tl.arange(0, PAGE)
    p_q = (i_q * H + heads[:, None])
    b_ql = tl.load(q_lat + p_q * DC + o_c[None, :], mask=m_h[:, None], other=0.0).to(tl.float32)
    b_qr = tl.load(q_rope + p_q * DR + o_r[None, :], mask=m_h[:, None], other=0.0).to(tl.float32)

    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, DC], dtype=tl.float32)
    for i_p in range(0, tl.cdiv(pos + 1, PAGE)):
        page = tl.load(block_table + i_n * max_pages + i_p).to(tl.int64)
        valid = i_p * PAGE + o_s <= pos
        p_slot = (page * PAGE + o_s[:, None]) * (DC + DR)
        # masked loads: slots past the sequence end may hold anything, even NaN
        b_kv = tl.load(cache + p_slot + o_c[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        b_kr = tl.load(cache + p_slot + DC + o_r[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.dot(b_ql, tl.trans(b_kv), input_precision=PRECISION)
        s += tl.dot(b_qr, tl.trans(b_kr), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, b_kv, input_precision=PRECISION)
        m_i = m_new
    b_o = acc / l_i[:, None]
    tl.store(out + p_q * DC + o_c[None, :], b_o.to(out.dtype.element_ty), mask=m_h[:, None])
