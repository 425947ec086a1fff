"""MXFP4 weights: pack/unpack of ``*_blocks``/``*_scales`` tensors and a dequantize+matmul kernel.

    x       [M, K]            activations, float32/float16/bfloat16
    blocks  [N, K/32, 16]     uint8, two E2M1 codes per byte (low nibble first)
    scales  [N, K/32]         uint8 E8M0 exponents (2^(s - 127); 0xFF = NaN)
    ->      [M, N]            x W^T in x's dtype, fp32 accumulation

:func:`mxfp4_matmul` runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``; packing and
unpacking are plain PyTorch (load-time work).
"""

from __future__ import annotations

import torch
import triton

from crescent.kernels import _triton
from crescent.kernels._triton import check_device, check_float
from crescent.kernels.mxfp4.matmul import mxfp4_matmul_kernel
from crescent.kernels.mxfp4.packed import Mxfp4Tensor
from crescent.kernels.mxfp4.reference import (
    BLOCK,
    E2M1_VALUES,
    E8M0_NAN,
    dequantize_mxfp4,
    e8m0_to_float,
    mxfp4_matmul_reference,
    quantize_mxfp4,
)

__all__ = [
    "BLOCK",
    "E2M1_VALUES",
    "E8M0_NAN",
    "Mxfp4Tensor",
    "e8m0_to_float",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "mxfp4_matmul",
    "mxfp4_matmul_reference",
]


def mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x ``[M, K]`` times the transpose of the MXFP4 weight ``[N, K]``; see the module doc."""
    check_float("x", x)
    if x.dim() != 2 or blocks.dim() != 3 or blocks.shape[2] != 16:
        raise ValueError(f"need x [M, K] and blocks [N, K/32, 16], got {tuple(x.shape)}, {tuple(blocks.shape)}")
    n, nb = blocks.shape[:2]
    if x.shape[1] != nb * BLOCK:
        raise ValueError(f"x has K={x.shape[1]} but the weight holds {nb} blocks of {BLOCK}")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or scales.shape != (n, nb):
        raise ValueError(f"blocks and scales must be uint8, scales of shape ({n}, {nb})")
    check_device(x, blocks, scales)
    m = x.shape[0]
    out = _triton.alloc((m, n), dtype=x.dtype, device=x.device)
    bm, bn = 16, 32
    mxfp4_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x.contiguous(), blocks.contiguous(), scales.contiguous(), out, m, n, x.shape[1],
        BM=bm, BN=bn, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return out
