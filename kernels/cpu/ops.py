"""The dense engine's CPU ops for Llama-family models, written for numerical reproducibility.

Disaggregated serving must give the same tokens as a single-process run: a request's decode
steps are batched with whatever else is running, and its prefix may come from a cache instead
of this forward pass. Every op here therefore computes a row's result from that row alone,
whatever the batch around it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# A row's result must not depend on the rows around it. MKL's sgemm (behind F.linear) uses other
# tail kernels for M in {1, 2, 3, 5, 6, 7, 9, ...} than for M >= 16 or a multiple of 4, so the same
# row differs by ~4e-5 between batch sizes: enough to flip a greedy argmax now and then. oneDNN's
# inner product gives the same row for every M >= 2 and reads prepacked weights, which also makes
# it faster here (measured: decode steps ~20% faster, prefill ~15%). A lone row is duplicated so
# it takes the M >= 2 path. ``_linear_pointwise`` takes the activations as they are (no
# conversion to oneDNN's layout and back around every projection, ~9% of a decode step) and
# gives the same bits as ``mkldnn_linear`` on converted activations. Without oneDNN, small batches are padded to a multiple of 4 rows for
# MKL instead. tests/kernels/test_cpu_ops.py checks the property for the active backend.
#
# Neither library is on a GPU, and cuBLAS picks its kernel (and split-K) by shape, so CUDA tensors
# go to the Triton kernels of ``crescent.kernels.batch_invariant`` (one fixed reduction order per
# row): ``InvariantLinear``, ``batch_invariant_linear`` and ``rms_norm`` never silently fall back
# to a batch-dependent path. Triton is imported only then; a CPU-only install needs none.
_ONEDNN = torch.backends.mkldnn.is_available()
_MKL_ROW_TILE = 4
_MKL_ALWAYS_INVARIANT_ROWS = 16


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether ``t`` goes to the Triton kernels (a function, so tests can send CPU tensors there
    under the Triton interpreter)."""
    return t.is_cuda  # (not device.type: ~7x cheaper, and it runs on every linear and norm)


def _triton_ops():
    from crescent.kernels import batch_invariant  # Triton: imported only where a GPU is used

    return batch_invariant


class InvariantLinear:
    """``x @ weight.T`` for 2-D ``x`` (rows, in), each row's result independent of the batch."""

    __slots__ = ("weight", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        if _on_gpu(weight):  # kept in its dtype (bf16 checkpoints stay bf16 on the device)
            self.weight = weight.contiguous()
            return
        weight = weight.float().contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if _ONEDNN else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if _on_gpu(x):
            return _triton_ops().invariant_linear(x, self.weight)
        if _ONEDNN:
            if rows == 1:
                x = x.expand(2, -1)
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, None, "none", [], "")[:rows]
        return batch_invariant_linear(x, self.weight)


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """MKL fallback of ``InvariantLinear``: pads small batches to a multiple of 4 rows (CUDA: Triton).
    The weight is taken in x's dtype on both (K3's reference ops hand a bf16 model an expert
    dequantized from MXFP4 in fp32; MXFP4 values are exact in bf16, so nothing is rounded)."""
    weight = weight.to(x.dtype)  # a no-op where they agree
    if _on_gpu(x):
        return _triton_ops().invariant_linear(x, weight)
    rows = x.shape[0]
    if rows < _MKL_ALWAYS_INVARIANT_ROWS and rows % _MKL_ROW_TILE:
        padded = x.new_zeros((rows + _MKL_ROW_TILE - rows % _MKL_ROW_TILE, x.shape[1]))
        padded[:rows] = x
        return F.linear(padded, weight)[:rows]
    return F.linear(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim (CUDA: the Triton kernel)."""
    if _on_gpu(x):
        return _triton_ops().invariant_rms_norm(x, weight, eps)
    variance = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * weight


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` for ``gate_up`` = [gate | up] on the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (max_positions, head_dim) for rotate-half RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. ``x``: (tokens, heads, head_dim); ``cos``/``sin``: (tokens, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def paged_attention(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, context_len: int, scale: float
) -> torch.Tensor:
    """Causal attention of one sequence's new queries over its paged KV.

    q: (new_tokens, heads, head_dim), the last ``new_tokens`` positions of the context.
    k_pages, v_pages: (pages, block_size, kv_heads, head_dim) each, contiguous, the sequence's pages
    in order (gathered apart: one copy each, and the tokens are then a view).
    Returns (new_tokens, heads, head_dim).
    """
    new_tokens, heads, head_dim = q.shape
    pages, block_size, kv_heads, _ = k_pages.shape
    k = k_pages.view(pages * block_size, kv_heads, head_dim)[:context_len]
    v = v_pages.view(pages * block_size, kv_heads, head_dim)[:context_len]
    q_t, k_t, v_t = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    mask = None
    causal = False
    if new_tokens == context_len and new_tokens > 1:
        causal = True  # a prompt with nothing cached: the fused causal kernel is ~2x faster than a mask
    elif new_tokens > 1:
        # Query i sits at position context_len - new_tokens + i and sees keys up to there.
        query_pos = torch.arange(context_len - new_tokens, context_len)[:, None]
        mask = torch.arange(context_len)[None, :] <= query_pos
    out = F.scaled_dot_product_attention(
        q_t, k_t, v_t, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=kv_heads != heads
    )
    return out[0].transpose(0, 1)
