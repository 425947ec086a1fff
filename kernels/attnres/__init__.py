"""Block Attention Residuals: softmax mix over depth with a learned per-layer pseudo-query.

    sources      [N, T, D]   block representations (embedding, completed blocks, partial block)
    query        [D]         the layer's pseudo-query w_l
    norm_weight  [D]         RMSNorm weight applied to the keys (optional)
    ->           [T, D]      the layer's input, in the sources' dtype

:func:`block_attn_res` runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton

from crescent.kernels import _triton
from crescent.kernels._triton import check_device, check_float
from crescent.kernels.attnres.mix import block_attn_res_kernel
from crescent.kernels.attnres.reference import block_attn_res_reference

__all__ = ["block_attn_res", "block_attn_res_reference"]

MAX_SOURCES = 64


def block_attn_res(
    sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """h = sum_n softmax_n(<query, RMSNorm(v_n)>) v_n for every token; see the module doc."""
    check_float("sources", sources)
    if sources.dim() != 3:
        raise ValueError(f"sources must be [N, T, D], got {tuple(sources.shape)}")
    n, t, d = sources.shape
    if not 1 <= n <= MAX_SOURCES:
        raise ValueError(f"need 1..{MAX_SOURCES} sources, got {n}")
    if query.shape != (d,) or (norm_weight is not None and norm_weight.shape != (d,)):
        raise ValueError(f"query and norm_weight must be [{d}]")
    check_device(sources, query)
    qw = query.float() * (norm_weight.float() if norm_weight is not None else 1.0)
    out = _triton.alloc((t, d), dtype=sources.dtype, device=sources.device)
    if t == 0:
        return out
    block_attn_res_kernel[(t,)](
        sources.contiguous(), qw.contiguous(), out, n, t, d, eps,
        BN=max(2, triton.next_power_of_2(n)), BD=min(1024, triton.next_power_of_2(d)),
    )
    return out
