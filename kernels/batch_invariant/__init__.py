"""Batch-invariant linear and RMSNorm in Triton: a row's bits do not depend on its batch.

    invariant_linear(x [..., K], weight [N, K], bias [N] | None) -> [..., N]
    invariant_rms_norm(x [..., D], weight [D], eps) -> [..., D]

Inputs float32, float16 or bfloat16 (x and weight of one dtype; RMSNorm's weight may be any of
them), any strides; fp32 accumulation; the output takes x's dtype. Each output row is reduced in one order fixed by K
(or D) alone: one tile shape for every M, no split-K, no atomics (``linear.py`` says why).
float32 dots are IEEE fp32 (no TF32), so results stay within fp32 rounding of ``F.linear``.
The engine reaches these through ``crescent.kernels.cpu.ops`` (``InvariantLinear``,
``batch_invariant_linear``, ``rms_norm``), which sends CUDA tensors here. Runs on CUDA, or on
CPU under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton

from crescent.kernels import _triton
from crescent.kernels._triton import check_device, check_float
from crescent.kernels.batch_invariant.linear import invariant_linear_kernel
from crescent.kernels.batch_invariant.reference import linear_reference, rms_norm_reference
from crescent.kernels.batch_invariant.rms_norm import invariant_rms_norm_kernel

__all__ = ["invariant_linear", "invariant_rms_norm", "linear_reference", "rms_norm_reference"]

# One tile shape for every M: choosing it by M (autotuning) would change a row's sum order.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
RMS_BLOCK_MAX = 1024


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with each row's result independent of the other rows; see module doc."""
    check_float("x", x)
    check_float("weight", weight)
    if x.dim() == 0 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x must be [..., K] and weight [N, K] with the same K, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must have one dtype")
    lead, (n, k) = x.shape[:-1], weight.shape
    x = x.reshape(-1, k)
    m = x.shape[0]
    if bias is not None:
        check_float("bias", bias)
        if bias.shape != (n,):
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    check_device(x, weight, *(() if bias is None else (bias,)))
    out = _triton.alloc((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0 or k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    upcast = _triton.interpreting() and x.dtype != torch.float32
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    invariant_linear_kernel[grid](
        x, weight, x if bias is None else bias, out, m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, UPCAST=upcast,
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return out.view(*lead, n)


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, each row reduced in one fixed order; see module doc."""
    check_float("x", x)
    check_float("weight", weight)
    d = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or weight.shape != (d,):
        raise ValueError(f"x must be [..., D] and weight [D], got {tuple(x.shape)} and {tuple(weight.shape)}")
    check_device(x, weight)
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = _triton.alloc(tuple(rows.shape), dtype=x.dtype, device=x.device)
    if rows.shape[0] and d:
        block = min(triton.next_power_of_2(d), RMS_BLOCK_MAX)
        invariant_rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, d, rows.stride(0),
                                                    out.stride(0), float(eps), BLOCK_D=block)
    return out.view(x.shape)
