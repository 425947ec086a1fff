"""Test oracle for paged attention over Crescent's KV pool: gather each sequence, float64 softmax.

Pool layout (``services/engine/kv_cache.py``): the pool is (pages, layers, 2, block_size, kv_heads,
head_dim); one layer's keys are the view ``pool[:, layer, 0]`` = (pages, block_size, kv_heads,
head_dim), strided (a page's stride spans all layers). Sequence i's token t lives in page
``block_tables[i, t // block_size]``, slot ``t % block_size``. For tests only; the engine's CPU
path is ``crescent.kernels.cpu`` (gather + SDPA, and the C++ decode op).
"""

from __future__ import annotations

import torch


def paged_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention of each sequence's queries (its last tokens) over its pages.

    q ``[T, H, D]``; k_pool, v_pool ``[P, S, KV, D]``; block_tables ``[N, max_pages]``;
    seq_lens ``[N]`` (tokens in the cache, this step's included); cu_q ``[N + 1]``.
    Returns ``[T, H, D]`` float32.
    """
    out = torch.zeros(q.shape, dtype=torch.float32)
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = q.shape[1] // kv_heads
    for i in range(seq_lens.shape[0]):
        q0, q1, length = int(cu_q[i]), int(cu_q[i + 1]), int(seq_lens[i])
        if q1 == q0:
            continue
        pos = torch.arange(length)
        pages = block_tables[i].cpu().long()[pos // block_size]
        k = k_pool.cpu()[pages, pos % block_size].double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_pool.cpu()[pages, pos % block_size].double().repeat_interleave(group, dim=1)
        qi = q[q0:q1].cpu().double()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(length - (q1 - q0), length)[:, None]
        scores = scores.masked_fill(pos[None, :] > q_pos, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).float()
    return out
