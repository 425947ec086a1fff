"""Test oracles for the batch-invariant linear and RMSNorm: plain PyTorch in float64.

float64 makes the oracle's own rounding negligible next to the kernels' fp32 accumulation, so
a tolerance measures the kernel alone. These are for tests; the engine's CPU ops are in
``crescent.kernels.cpu``.
"""

from __future__ import annotations

import torch


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in float64, returned in float32. x ``[M, K]``, weight ``[N, K]``."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.float()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, in float64, returned in float32."""
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).float()
