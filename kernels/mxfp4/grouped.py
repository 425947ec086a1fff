"""Grouped MXFP4 matmul: rows sorted by expert, each expert's rows times that expert's packed weight.

    x              [M, K]            rows sorted by expert (float32/float16/bfloat16)
    blocks         [E, N, K/32, 16]  uint8 E2M1 codes (``Mxfp4Tensor.blocks`` of stacked experts)
    scales         [E, N, K/32]      uint8 E8M0 exponents
    group_offsets  [E + 1]           int32/int64, 0 first, M last, non-decreasing
    ->             [M, N]            ``out[r] = x[r] @ W_e^T`` for the expert e owning row r

The MoE path of kimi_k3 on CUDA with experts kept packed: one launch per projection, the tile
schedule of ``crescent.kernels.moe.grouped_matmul`` (tiles found on the device, grid an upper
bound, so the host never waits for the group sizes) and the block decoding of
``crescent.kernels.mxfp4.matmul`` (each 32-element block decoded in registers). Runs on CUDA,
or on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from crescent.kernels import _triton
from crescent.kernels._triton import check_device, check_float


@triton.jit
def grouped_mxfp4_kernel(
    x, blocks, scales, out, group_offsets, tile_offsets, E, N, KD,
    BE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    i_n = tl.program_id(1)
    if pid >= tl.load(tile_offsets + E):
        return
    o_e = tl.arange(0, BE)
    tiles_through = tl.load(tile_offsets + 1 + o_e, mask=o_e < E, other=2147483647)
    i_e = tl.sum((tiles_through <= pid).to(tl.int32), 0)
    i_m = pid - tl.load(tile_offsets + i_e)
    start = tl.load(group_offsets + i_e).to(tl.int64)
    end = tl.load(group_offsets + i_e + 1).to(tl.int64)
    rows = start + i_m * BM + tl.arange(0, BM)
    cols = i_n * BN + tl.arange(0, BN)
    m_r = rows < end
    m_c = cols < N
    nb = KD // 32
    row_of_col = i_e.to(tl.int64) * N + cols.to(tl.int64)  # weight row (expert, output column)
    o_byte = tl.arange(0, 16)
    o_k = tl.arange(0, 32)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i_b in range(0, nb):
        b = tl.load(blocks + (row_of_col[:, None] * nb + i_b) * 16 + o_byte[None, :], mask=m_c[:, None], other=0)
        codes = tl.reshape(tl.join(b.to(tl.int32) & 15, b.to(tl.int32) >> 4), (BN, 32))  # low nibble first
        sign = tl.where((codes & 8) != 0, -1.0, 1.0)
        e = (codes >> 1) & 3
        man = (codes & 1).to(tl.float32)
        mag = tl.where(e == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((e - 1).to(tl.float32)))
        s = tl.load(scales + row_of_col * nb + i_b, mask=m_c, other=127).to(tl.float32)
        factor = tl.where(s == 255.0, float("nan"), tl.exp2(tl.minimum(s, 254.0) - 127.0))  # E8M0 0xFF = NaN
        w = sign * mag * factor[:, None]
        a = tl.load(x + rows[:, None] * KD + i_b * 32 + o_k[None, :], mask=m_r[:, None], other=0.0)
        acc += tl.dot(a.to(tl.float32), tl.trans(w), input_precision=PRECISION)
    tl.store(out + rows[:, None] * N + cols[None, :], acc.to(out.dtype.element_ty), mask=m_r[:, None] & m_c[None, :])


def grouped_mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                         group_offsets: torch.Tensor) -> torch.Tensor:
    """See the module doc. fp32 accumulation; the output is in x's dtype."""
    check_float("x", x)
    if x.dim() != 2 or blocks.dim() != 4 or blocks.shape[3] != 16 or scales.shape != blocks.shape[:3]:
        raise ValueError(f"need x [M, K], blocks [E, N, K/32, 16], scales [E, N, K/32]; got "
                         f"{tuple(x.shape)}, {tuple(blocks.shape)}, {tuple(scales.shape)}")
    e, n, nb = scales.shape
    if x.shape[1] != nb * 32:
        raise ValueError(f"x has K={x.shape[1]} but the weights hold {nb} blocks of 32")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError("blocks and scales must be uint8")
    if group_offsets.shape != (e + 1,) or group_offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_offsets must be int32/int64 [{e + 1}]")
    check_device(x, blocks, scales, group_offsets)
    m = x.shape[0]
    out = _triton.alloc((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn = 16, 32
    tile_offsets = _triton.row_tile_offsets(group_offsets, bm)
    grouped_mxfp4_kernel[(triton.cdiv(m, bm) + e, triton.cdiv(n, bn))](
        x.contiguous(), blocks.contiguous(), scales.contiguous(), out, group_offsets, tile_offsets, e, n, x.shape[1],
        BE=max(2, triton.next_power_of_2(e)), BM=bm, BN=bn,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return out
