"""Kimi Delta Attention (KDA): chunked prefill and fused recurrent decode, as Triton kernels.

Shapes and dtypes (q, k, v, g, beta in float32, float16 or bfloat16; states always float32):

    q, k   [B, T, H, K]    raw queries/keys; the kernels L2-normalise them and scale q
    v      [B, T, HV, V]   HV a multiple of H (grouped value heads)
    g      [B, T, HV, K]   per-channel log decay (<= 0; chunked prefill needs g >= -10 per
                           token, which the K3 gate ``lb * sigmoid(...)`` with lb = -5 guarantees)
    beta   [B, T, HV]      write strength in (0, 1), i.e. already sigmoid(b)
    state  [N, HV, K, V]   fp32 recurrent state, one per sequence
    cu_seqlens [N + 1]     int32/int64 cumulative sequence offsets; then B must be 1

K and V must be powers of two in [16, 256]. Outputs ``o`` are ``[B, T, HV, V]`` in v's dtype.

The kernels run on CUDA, or on CPU under ``TRITON_INTERPRET=1`` (tests). There is no silent
fallback: other devices raise ValueError. The layer pieces around the attention — the K3 gate,
the short convolution and the gated output norm — are plain PyTorch ops (memory-bound, small),
exported here from :mod:`.reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from crescent.kernels import _triton
from crescent.kernels._triton import check_device, check_float, check_pow2, check_shape
from crescent.kernels.kda.chunk import kda_chunk_fwd_kernel
from crescent.kernels.kda.recurrent import kda_recurrent_fwd_kernel
from crescent.kernels.kda.reference import (
    chunk_kda_reference,
    gated_rms_norm_reference as gated_rms_norm,
    kda_gate,
    l2_normalize,
    recurrent_kda_reference,
    short_conv_reference as short_conv,
)

__all__ = [
    "chunk_kda",
    "chunk_kda_with_snapshots",
    "KdaPrefill",
    "fused_recurrent_kda",
    "kda_decode",
    "kda_gate",
    "short_conv",
    "gated_rms_norm",
    "l2_normalize",
    "recurrent_kda_reference",
    "chunk_kda_reference",
]

CHUNK_SIZE = 16


def _check(q, k, v, g, beta, initial_state, cu_seqlens) -> tuple[int, int, int, int, int, int]:
    """Validate shapes before any launch; returns (B, T, H, HV, K, V)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_float(name, t)
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q and v must be 4-D [B, T, heads, dim], got {tuple(q.shape)}, {tuple(v.shape)}")
    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    check_shape("k", k, q.shape)
    check_shape("v", v, (b, t, hv, dv))
    check_shape("g", g, (b, t, hv, dk))
    check_shape("beta", beta, (b, t, hv))
    if hv % h:
        raise ValueError(f"value heads HV={hv} must be a multiple of q/k heads H={h}")
    check_pow2("K (q/k head dim)", dk)
    check_pow2("V (value head dim)", dv)
    n = b
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B=1, got B={b}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor [N + 1]")
        # one host read: offsets must be monotone and cover the packed tokens exactly
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != t or any(a > c for a, c in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T={t}, got {cu}")
        n = len(cu) - 1
    if initial_state is not None:
        check_shape("initial_state", initial_state, (n, hv, dk, dv))
        if initial_state.dtype != torch.float32:
            raise ValueError(f"initial_state must be float32, got {initial_state.dtype}")
    check_device(q, k, v, g, beta, *(x for x in (initial_state, cu_seqlens) if x is not None))
    return b, t, h, hv, dk, dv


def _launch(kind, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, every=0):
    b, t, h, hv, dk, dv = _check(q, k, v, g, beta, initial_state, cu_seqlens)
    n = b if cu_seqlens is None else cu_seqlens.numel() - 1
    snaps = snap_offsets = None
    if every:
        if every % CHUNK_SIZE:
            raise ValueError(f"snapshot interval {every} must be a multiple of {CHUNK_SIZE}")
        lens = torch.full((n,), t, device=q.device) if cu_seqlens is None else cu_seqlens[1:] - cu_seqlens[:-1]
        snap_offsets = torch.zeros(n + 1, dtype=torch.int64, device=q.device)
        snap_offsets[1:] = (lens // every).cumsum(0)
        total = int(snap_offsets[-1])
        snaps = _triton.alloc((total, hv, dk, dv), dtype=torch.float32, device=q.device)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    o = _triton.alloc(v.shape, dtype=v.dtype, device=v.device)
    ht = _triton.alloc((n, hv, dk, dv), dtype=torch.float32, device=q.device) if output_final_state else None
    scale = dk ** -0.5 if scale is None else float(scale)
    bv = min(dv, 64)
    grid = (n * hv, triton.cdiv(dv, bv))
    common = dict(
        H=h, HV=hv, K=dk, V=dv, BV=bv,
        IS_VARLEN=cu_seqlens is not None, USE_H0=h0 is not None, STORE_HT=ht is not None,
    )
    if kind == "chunk":
        kda_chunk_fwd_kernel[grid](
            q, k, v, g, beta, o, h0, ht, cu_seqlens, snaps, snap_offsets, scale, t,
            BT=CHUNK_SIZE, LOG2_BT=CHUNK_SIZE.bit_length() - 1, SNAP_EVERY=every, **common,
        )
        if every:
            return o, ht, snaps, snap_offsets
    else:
        kda_recurrent_fwd_kernel[grid](
            q, k, v, g, beta, o, h0, ht, cu_seqlens, None, scale, t,
            USE_STATE_IDX=False, **common,
        )
    return o, ht


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA prefill. Returns (o, final state ``[N, HV, K, V]`` or None).

    ``scale`` defaults to 1/sqrt(K). ``initial_state`` resumes each sequence from a cached
    state (e.g. a prefix hit); the final state is what a later prefill chunk or decode resumes.
    """
    return _launch("chunk", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


@dataclass(frozen=True, slots=True)
class KdaPrefill:
    """Result of :func:`chunk_kda_with_snapshots`."""

    o: torch.Tensor  # [B, T, HV, V]
    final_state: torch.Tensor  # [N, HV, K, V] fp32
    snapshots: torch.Tensor  # [S, HV, K, V] fp32, sequence by sequence
    snapshot_offsets: torch.Tensor  # [N + 1] int64: sequence i owns snapshots[off[i]:off[i+1]]


def chunk_kda_with_snapshots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    every: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> KdaPrefill:
    """:func:`chunk_kda` that also keeps the state after every ``every`` tokens of each sequence.

    Snapshot j of sequence i is the state after its first (j + 1) * every tokens *of this call*
    (floor(len_i / every) of them); a prefill that resumes a cached prefix at a block boundary
    with ``every`` = the cache's block size thus yields the state at each new block boundary,
    what state-aware prefix caching stores. ``every`` must be a multiple of 16.
    """
    if every <= 0:
        raise ValueError(f"every must be a positive multiple of {CHUNK_SIZE}, got {every}")
    o, ht, snaps, offsets = _launch("chunk", q, k, v, g, beta, scale, initial_state, True, cu_seqlens, every)
    return KdaPrefill(o=o, final_state=ht, snapshots=snaps, snapshot_offsets=offsets)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA with the same interface as :func:`chunk_kda` (any g <= 0 allowed)."""
    return _launch("recurrent", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step for N sequences; updates ``state`` in place and returns o ``[N, HV, V]``.

    q, k ``[N, H, K]``; v ``[N, HV, V]``; g ``[N, HV, K]``; beta ``[N, HV]``. ``state`` is
    ``[N, HV, K, V]`` fp32, or with ``state_indices`` (``[N]`` int) a pool ``[P, HV, K, V]``
    from which sequence i uses slot ``state_indices[i]`` (slots must be distinct).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [N, H, K] for a decode step, got {tuple(q.shape)}")
    n = q.shape[0]
    slots = n
    if state_indices is not None:
        check_shape("state_indices", state_indices, (n,))
        if state_indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"state_indices must be int32/int64, got {state_indices.dtype}")
        slots = state.shape[0]
    if state.dim() != 4 or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("state must be a contiguous float32 [slots, HV, K, V] tensor")
    # a decode step is a length-1 sequence per batch row: reuse the 4-D checks
    q4, k4, v4, g4, b4 = (x.unsqueeze(1) for x in (q, k, v, g, beta))
    _, _, h, hv, dk, dv = _check(q4, k4, v4, g4, b4, None, None)
    check_shape("state", state, (slots, hv, dk, dv))
    check_device(state)
    q4, k4, v4, g4, b4 = (x.contiguous() for x in (q4, k4, v4, g4, b4))
    o = _triton.alloc(v4.shape, dtype=v4.dtype, device=v4.device)
    bv = min(dv, 64)
    kda_recurrent_fwd_kernel[(n * hv, triton.cdiv(dv, bv))](
        q4, k4, v4, g4, b4, o, state, state, None, state_indices,
        dk ** -0.5 if scale is None else float(scale), 1,
        H=h, HV=hv, K=dk, V=dv, BV=bv, IS_VARLEN=False, USE_H0=True, STORE_HT=True,
        USE_STATE_IDX=state_indices is not None,
    )
    return o.squeeze(1)
