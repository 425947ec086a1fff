"""fp32 references for gated Multi-head Latent Attention (MLA) over a paged latent cache.

Per token the cache keeps only the compressed latent c_kv (``[Dc]``) and the decoupled RoPE
key k_rope (``[Dr]``, shared by all heads). Per head h, with up-projections W_uk ``[H, Dc, Dn]``
and W_uv ``[H, Dc, Dv]``:

    k_h = [c_kv W_uk_h, k_rope],  v_h = c_kv W_uv_h,  o_h = softmax(q_h . k_h * scale) v_h

Absorbed form (what the kernel computes, no per-head K/V ever materialised):
    q_lat_h = W_uk_h q_nope_h  (``[Dc]``),  score = q_lat_h . c_kv + q_rope_h . k_rope,
    o_lat_h = sum_t p_t c_kv_t,  o_h = o_lat_h W_uv_h.
The layer output is gated: o_h * sigmoid(gate_h(x)) before the output projection.

Cache layout: ``[num_pages, block_size, Dc + Dr]`` (c_kv then k_rope per slot); a block table
``[N, max_pages]`` lists each sequence's pages in order.
"""

from __future__ import annotations

import torch


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope ``[T, H, Dn]`` and W_uk ``[H, Dc, Dn]`` -> q_lat ``[T, H, Dc]``."""
    return torch.einsum("thn,hcn->thc", q_nope.float(), w_uk.float())


def expand_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat ``[T, H, Dc]`` and W_uv ``[H, Dc, Dv]`` -> o ``[T, H, Dv]``."""
    return torch.einsum("thc,hcv->thv", o_lat.float(), w_uv.float())


def apply_output_gate(o: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """Gated MLA: o ``[T, H, Dv]`` times sigmoid(gate_logits ``[T, H]`` or ``[T, H, Dv]``)."""
    g = torch.sigmoid(gate_logits.float())
    return (o.float() * (g[..., None] if g.dim() == 2 else g)).to(o.dtype)


def write_latent_cache(
    cache: torch.Tensor, block_table: torch.Tensor, seq: int, start: int, c_kv: torch.Tensor, k_rope: torch.Tensor
) -> None:
    """Store tokens start.. of sequence ``seq`` (c_kv ``[T, Dc]``, k_rope ``[T, Dr]``) in place."""
    block_size, dc = cache.shape[1], c_kv.shape[-1]
    pos = torch.arange(start, start + c_kv.shape[0], device=cache.device)
    pages = block_table[seq, pos // block_size].long()
    slots = pos % block_size
    cache[pages, slots, :dc] = c_kv.to(cache.dtype)
    cache[pages, slots, dc:] = k_rope.to(cache.dtype)


def mla_attention_reference(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    c_kv: torch.Tensor,
    k_rope: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Non-absorbed causal MLA for one sequence whose last ``Tq`` tokens are the queries.

    q_nope ``[Tq, H, Dn]``, q_rope ``[Tq, H, Dr]``, c_kv ``[Tk, Dc]``, k_rope ``[Tk, Dr]``
    (Tk >= Tq; query i sits at position Tk - Tq + i). Returns o ``[Tq, H, Dv]`` in fp32.
    """
    tq, tk = q_nope.shape[0], c_kv.shape[0]
    k_nope = torch.einsum("tc,hcn->thn", c_kv.float(), w_uk.float())
    v = torch.einsum("tc,hcv->thv", c_kv.float(), w_uv.float())
    scores = torch.einsum("qhn,khn->hqk", q_nope.float(), k_nope)
    scores = scores + torch.einsum("qhr,kr->hqk", q_rope.float(), k_rope.float())
    pos_q = torch.arange(tk - tq, tk)[:, None]
    scores = scores.masked_fill(torch.arange(tk)[None, :] > pos_q, float("-inf")) * scale
    return torch.einsum("hqk,khv->qhv", torch.softmax(scores, dim=-1), v)
