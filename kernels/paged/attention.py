"""Triton attention over the paged KV pool: decode (one query per sequence, whole or in pieces
merged in order) and varlen prefill.

Keys are visited in tiles of TILE tokens (a power of two dividing the block size, so a tile never
straddles two pages), from position 0 upwards, with an online softmax in fp32. A query's result
therefore depends on its own sequence only, never on the batch: the order is fixed by positions.
In prefill a query whose tile of queries reaches further than itself walks extra key tiles that
are fully masked for it; those leave its running max, sum and accumulator bit-for-bit unchanged
(alpha = exp(0) = 1, p = 0), so a query's bits do not depend on how its prompt was chunked either.
Masked loads: slots past a sequence's end, and pages its table does not reach, are never read.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attend_tile(q_tile, k_pool, v_pool, table_row, key_start, n_keys, q_pos, head_off, acc, m_i, l_i, scale,
                 stride_ps, stride_ss, stride_ds, D,
                 TILE: tl.constexpr, PAGE: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys (positions key_start..+TILE) for the rows of ``q_tile`` at positions q_pos."""
    o_t = tl.arange(0, TILE)
    o_d = tl.arange(0, BD)
    page = tl.load(table_row + key_start // PAGE).to(tl.int64)
    key_pos = key_start + o_t
    m_key = key_pos < n_keys
    slots = (page * stride_ps + ((key_start % PAGE) + o_t).to(tl.int64) * stride_ss)[:, None] + head_off
    ptr_off = slots + o_d[None, :].to(tl.int64) * stride_ds
    m_load = m_key[:, None] & (o_d < D)[None, :]
    k = tl.load(k_pool + ptr_off, mask=m_load, other=0.0).to(tl.float32)
    v = tl.load(v_pool + ptr_off, mask=m_load, other=0.0).to(tl.float32)
    s = tl.dot(q_tile, tl.trans(k), input_precision=PRECISION) * scale
    visible = m_key[None, :] & (key_pos[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def paged_decode_kernel(
    q, k_pool, v_pool, block_tables, seq_lens, out, scale,
    H, D, GROUP,
    stride_qn, stride_qh, stride_on, stride_oh, stride_bt,
    stride_ps, stride_ss, stride_hs, stride_ds,
    TILE: tl.constexpr, PAGE: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per (sequence, KV head): the KV head's GROUP query heads share every key tile."""
    i_n = tl.program_id(0).to(tl.int64)
    i_kv = tl.program_id(1).to(tl.int64)
    n_keys = tl.load(seq_lens + i_n).to(tl.int64)
    heads = i_kv * GROUP + tl.arange(0, BG)
    m_h = tl.arange(0, BG) < GROUP
    o_d = tl.arange(0, BD)
    m_qd = m_h[:, None] & (o_d < D)[None, :]
    q_tile = tl.load(q + i_n * stride_qn + heads[:, None] * stride_qh + o_d[None, :], mask=m_qd, other=0.0)
    q_tile = q_tile.to(tl.float32)
    q_pos = tl.zeros([BG], dtype=tl.int64) + n_keys - 1  # the query is the sequence's last token
    m_i = tl.full([BG], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BG], dtype=tl.float32)
    acc = tl.zeros([BG, BD], dtype=tl.float32)
    for t in range(0, tl.cdiv(n_keys, TILE)):
        acc, m_i, l_i = _attend_tile(q_tile, k_pool, v_pool, block_tables + i_n * stride_bt, t * TILE, n_keys,
                                     q_pos, i_kv * stride_hs, acc, m_i, l_i, scale,
                                     stride_ps, stride_ss, stride_ds, D,
                                     TILE=TILE, PAGE=PAGE, BD=BD, PRECISION=PRECISION)
    o = acc / l_i[:, None]
    tl.store(out + i_n * stride_on + heads[:, None] * stride_oh + o_d[None, :], o.to(out.dtype.element_ty), mask=m_qd)


@triton.jit
def paged_prefill_kernel(
    q, k_pool, v_pool, block_tables, seq_lens, cu_q, seq_of_block, first_block, out, scale,
    N, D, GROUP,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_ps, stride_ss, stride_hs, stride_ds,
    BQ: tl.constexpr, TILE: tl.constexpr, PAGE: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per (block of BQ queries of one sequence, query head)."""
    i_b = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_n = tl.load(seq_of_block + i_b).to(tl.int64)
    if i_n < N:  # the grid is sized without a host sync: spare programs do nothing
        q_start = tl.load(cu_q + i_n).to(tl.int64)
        q_end = tl.load(cu_q + i_n + 1).to(tl.int64)
        n_keys = tl.load(seq_lens + i_n).to(tl.int64)
        row0 = q_start + (i_b - tl.load(first_block + i_n)).to(tl.int64) * BQ
        rows = row0 + tl.arange(0, BQ)
        m_rows = rows < q_end
        q_pos = n_keys - (q_end - q_start) + (rows - q_start)  # the chunk is the sequence's last tokens
        o_d = tl.arange(0, BD)
        m_qd = m_rows[:, None] & (o_d < D)[None, :]
        q_tile = tl.load(q + rows[:, None] * stride_qt + i_h * stride_qh + o_d[None, :], mask=m_qd, other=0.0)
        q_tile = q_tile.to(tl.float32)
        last_pos = tl.minimum(row0 + BQ, q_end) - 1 - q_start + n_keys - (q_end - q_start)
        m_i = tl.full([BQ], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BQ], dtype=tl.float32)
        acc = tl.zeros([BQ, BD], dtype=tl.float32)
        for t in range(0, tl.cdiv(last_pos + 1, TILE)):
            acc, m_i, l_i = _attend_tile(q_tile, k_pool, v_pool, block_tables + i_n * stride_bt, t * TILE, n_keys,
                                         q_pos, (i_h // GROUP) * stride_hs, acc, m_i, l_i, scale,
                                         stride_ps, stride_ss, stride_ds, D,
                                         TILE=TILE, PAGE=PAGE, BD=BD, PRECISION=PRECISION)
        o = acc / l_i[:, None]
        tl.store(out + rows[:, None] * stride_ot + i_h * stride_oh + o_d[None, :], o.to(out.dtype.element_ty),
                 mask=m_qd)


@triton.jit
def paged_decode_split_kernel(
    q, k_pool, v_pool, block_tables, seq_lens, part_o, part_ml, scale,
    H, D, GROUP, SPLITS,
    stride_qn, stride_qh, stride_bt,
    stride_ps, stride_ss, stride_hs, stride_ds,
    SPLIT: tl.constexpr, TILE: tl.constexpr, PAGE: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (sequence, KV head, SPLIT keys): the unnormalised partial output and its
    running max and sum, for ``paged_decode_combine_kernel``. Splits are fixed by position."""
    i_n = tl.program_id(0).to(tl.int64)
    i_kv = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2).to(tl.int64)
    n_keys = tl.load(seq_lens + i_n).to(tl.int64)
    if i_s * SPLIT < n_keys:  # splits past the sequence's end write nothing and are never read
        heads = i_kv * GROUP + tl.arange(0, BG)
        m_h = tl.arange(0, BG) < GROUP
        o_d = tl.arange(0, BD)
        m_qd = m_h[:, None] & (o_d < D)[None, :]
        q_tile = tl.load(q + i_n * stride_qn + heads[:, None] * stride_qh + o_d[None, :], mask=m_qd, other=0.0)
        q_tile = q_tile.to(tl.float32)
        q_pos = tl.zeros([BG], dtype=tl.int64) + n_keys - 1
        m_i = tl.full([BG], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BG], dtype=tl.float32)
        acc = tl.zeros([BG, BD], dtype=tl.float32)
        t_end = tl.minimum(tl.cdiv(n_keys, TILE), (i_s + 1) * (SPLIT // TILE))
        for t in range(i_s * (SPLIT // TILE), t_end):
            acc, m_i, l_i = _attend_tile(q_tile, k_pool, v_pool, block_tables + i_n * stride_bt, t * TILE, n_keys,
                                         q_pos, i_kv * stride_hs, acc, m_i, l_i, scale,
                                         stride_ps, stride_ss, stride_ds, D,
                                         TILE=TILE, PAGE=PAGE, BD=BD, PRECISION=PRECISION)
        row = (i_n * H + heads) * SPLITS + i_s  # part_o [N, H, SPLITS, D], part_ml [N, H, SPLITS, 2]
        tl.store(part_o + row[:, None] * D + o_d[None, :], acc, mask=m_qd)
        tl.store(part_ml + row * 2, m_i, mask=m_h)
        tl.store(part_ml + row * 2 + 1, l_i, mask=m_h)


@triton.jit
def paged_decode_combine_kernel(
    part_o, part_ml, seq_lens, out, H, D, SPLITS, stride_on, stride_oh,
    SPLIT: tl.constexpr, BD: tl.constexpr,
):
    """One program per (sequence, query head): the sequence's splits merged in split order. A
    single split gives acc / l, the bits of the unsplit kernel."""
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    n_keys = tl.load(seq_lens + i_n).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    l = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BD], dtype=tl.float32)
    base = (i_n * H + i_h) * SPLITS
    for s in range(0, tl.cdiv(n_keys, SPLIT)):
        m_s = tl.load(part_ml + (base + s) * 2 + tl.arange(0, 1))
        l_s = tl.load(part_ml + (base + s) * 2 + 1 + tl.arange(0, 1))
        o_s = tl.load(part_o + (base + s) * D + o_d, mask=m_d, other=0.0)
        m_new = tl.maximum(m, m_s)
        a = tl.exp(m - m_new)
        b = tl.exp(m_s - m_new)
        l = l * a + l_s * b
        acc = acc * a + o_s * b
        m = m_new
    tl.store(out + i_n * stride_on + i_h * stride_oh + o_d, (acc / l).to(out.dtype.element_ty), mask=m_d)
