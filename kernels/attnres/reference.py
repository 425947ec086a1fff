"""fp32 reference for Block Attention Residuals (AttnRes, arXiv 2603.15031).

Instead of summing every earlier layer's output with weight 1, a layer's input is a softmax
mix over depth of earlier *block representations* (the embedding, each completed block's sum
of layer outputs, and the current block's partial sum):

    k_n = RMSNorm(v_n) (weight gamma),   logit_n = <w_l, k_n>,   h_l = sum_n softmax(logit)_n v_n

w_l is the layer's learned pseudo-query (``[D]``), shared by all tokens; the softmax runs over
the N sources independently for every token.
"""

from __future__ import annotations

import torch


def block_attn_res_reference(
    sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """sources ``[N, T, D]``, query ``[D]``, norm_weight ``[D]`` -> (h ``[T, D]``, weights ``[N, T]``)."""
    v = sources.float()
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    if norm_weight is not None:
        keys = keys * norm_weight.float()
    weights = torch.softmax(keys @ query.float(), dim=0)  # [N, T]
    return (weights[..., None] * v).sum(0).to(sources.dtype), weights
