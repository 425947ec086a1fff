"""The engine's one attention seam: paged attention of a forward batch over one layer of the pool.

``attention_for(cache_device, cache_dtype, ...)`` picks the path by where the cache lives:

- CPU, float32, head dim 64: ``CpuKernelAttention``, today's path. Decode rows (one new token)
  go through the C++ op (``kernels/cpu/paged_decode.cpp``) straight over the pool in one
  call per layer; prompt chunks gather their pages and run SDPA per sequence.
- CUDA, when ``crescent.kernels.paged`` imports (the Triton kernels over Crescent's pool layout;
  a CPU-only install may lack Triton) and the head dim is at most 256: ``TritonAttention``, decode
  rows in one call per layer and prompt chunks in one varlen call. A larger head dim logs why and
  takes the torch path; a block size the kernels cannot take (not a multiple of 16) is refused at
  start by ``build_engine`` (``triton_block_size_problem``), since the operator can change it.
- anything else (CPU bf16, CUDA without that kernel, tests on ``meta``): ``TorchAttention``, the
  per-sequence gather + SDPA path, which runs on any device and dtype.

Every path computes a row from its own sequence only, so a row's result does not depend on the
batch around it (the invariance the disaggregated path relies on); which path ran is
``LlamaModel.attention_path`` (logged at start-up).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from crescent.kernels.cpu import paged_attention
from crescent.kernels.cpu.cpu_ext import paged_decode_ops

log = logging.getLogger(__name__)

TRITON_MODULE = "crescent.kernels.paged"  # paged_decode_attention, paged_prefill_attention
# What crescent.kernels.paged takes (its module docstring; it raises on anything else).
TRITON_MAX_HEAD_DIM = 256
TRITON_BLOCK_MULTIPLE = 16


class Chunk(Protocol):
    """What attention reads of a ``SeqChunk``."""

    context_len: int
    num_new: int


@dataclass(frozen=True, slots=True)
class AttentionBatch:
    """One forward's sequences, built once and reused by every layer."""

    chunks: Sequence[Chunk]
    page_tables: list[torch.Tensor]  # per chunk: its pages covering context_len, on the cache's device
    extra: object = None             # a path's own per-forward tensors (decode tables, varlen metadata)


class AttentionPath(Protocol):
    name: str

    def prepare(self, chunks: Sequence[Chunk], page_tables: list[torch.Tensor]) -> AttentionBatch: ...

    def __call__(self, batch: AttentionBatch, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """``q`` (rows, heads, head_dim); ``k_pool``/``v_pool`` (pages, block_size, kv_heads, head_dim)
        views of one layer of the pool (strided pages). Returns (rows, heads, head_dim) in q's dtype."""
        ...


class TorchAttention:
    """Per sequence: gather its pages (one copy each of K and V), then SDPA. Any device, any dtype."""

    name = "torch"

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def prepare(self, chunks: Sequence[Chunk], page_tables: list[torch.Tensor]) -> AttentionBatch:
        return AttentionBatch(chunks, page_tables)

    def __call__(self, batch: AttentionBatch, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        attn = torch.empty_like(q)
        self._per_sequence(batch, q, k_pool, v_pool, attn, skip_single=False)
        return attn

    def _per_sequence(self, batch: AttentionBatch, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      attn: torch.Tensor, *, skip_single: bool) -> None:
        # The reference op builds its causal mask with factory calls: on q's device, not the CPU's.
        on_device = contextlib.nullcontext() if q.device.type == "cpu" else torch.device(q.device)
        start = 0
        with on_device:
            for chunk, table in zip(batch.chunks, batch.page_tables):
                end = start + chunk.num_new
                if skip_single and chunk.num_new == 1:
                    start = end
                    continue
                # index_select, not pool[table]: the same copy at half the cost. K and V apart, so
                # each is one contiguous copy that attention takes as a view.
                k_pages = torch.index_select(k_pool, 0, table).to(q.dtype)
                v_pages = torch.index_select(v_pool, 0, table).to(q.dtype)
                attn[start:end] = paged_attention(q[start:end], k_pages, v_pages, chunk.context_len, self.scale)
                start = end


class CpuKernelAttention(TorchAttention):
    """Decode rows through the C++ op over the pool (one call per layer), prompt chunks per sequence."""

    name = "cpu-kernel"

    def __init__(self, scale: float, ops: ModuleType) -> None:
        super().__init__(scale)
        self._ops = ops

    def prepare(self, chunks: Sequence[Chunk], page_tables: list[torch.Tensor]) -> AttentionBatch:
        """The decode rows' (flat rows or None for all, padded page tables, context lengths)."""
        picked = [i for i, c in enumerate(chunks) if c.num_new == 1]
        if not picked:
            return AttentionBatch(chunks, page_tables)
        widest = max(page_tables[i].numel() for i in picked)
        tables = torch.zeros((len(picked), widest), dtype=torch.int64)
        for row, i in enumerate(picked):
            tables[row, : page_tables[i].numel()] = page_tables[i]
        lens = torch.tensor([chunks[i].context_len for i in picked], dtype=torch.int64)
        if len(picked) == len(chunks) == sum(c.num_new for c in chunks):
            return AttentionBatch(chunks, page_tables, (None, tables, lens))  # a pure decode step: every row
        offsets = torch.cumsum(torch.tensor([0] + [c.num_new for c in chunks[:-1]]), 0)
        return AttentionBatch(chunks, page_tables, (offsets[picked], tables, lens))

    def __call__(self, batch: AttentionBatch, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        if batch.extra is None:
            return super().__call__(batch, q, k_pool, v_pool)
        rows, tables, lens = batch.extra
        out = self._ops.paged_decode_attention(q if rows is None else q[rows], k_pool, v_pool, tables, lens, self.scale)
        if rows is None:
            return out
        attn = torch.empty_like(q)
        attn[rows] = out
        self._per_sequence(batch, q, k_pool, v_pool, attn, skip_single=True)
        return attn


class TritonAttention:
    """The Triton kernels of ``crescent.kernels.paged`` over the pool, two calls per layer at most:
    every decode row (one new token) through the decode kernel, every longer chunk through the
    varlen prefill kernel (sequence i's queries are its last ``cu_q[i+1] - cu_q[i]`` tokens). A
    decode row takes the decode kernel whether or not prompt chunks share its step, as on the
    CPU, so its bits do not depend on its batch."""

    name = "triton"

    def __init__(self, scale: float, kernels: ModuleType) -> None:
        self.scale = scale
        self._kernels = kernels

    def prepare(self, chunks: Sequence[Chunk], page_tables: list[torch.Tensor]) -> AttentionBatch:
        device = page_tables[0].device
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + c.num_new)
        decode = [i for i, c in enumerate(chunks) if c.num_new == 1]
        prompt = [i for i, c in enumerate(chunks) if c.num_new > 1]
        parts = []
        for picked, is_decode in ((decode, True), (prompt, False)):
            if not picked:
                continue
            widest = max(page_tables[i].numel() for i in picked)
            table = torch.zeros((len(picked), widest), dtype=torch.int32, device=device)
            for row, i in enumerate(picked):
                table[row, : page_tables[i].numel()] = page_tables[i]
            # Built on the host, moved once per forward (not per layer).
            lens = torch.tensor([chunks[i].context_len for i in picked], dtype=torch.int32)
            rows = torch.tensor([r for i in picked for r in range(starts[i], starts[i + 1])], dtype=torch.int64)
            cu_q = torch.tensor([0, *(chunks[i].num_new for i in picked)], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            every = len(picked) == len(chunks)  # all rows, in order: no gather, no scatter
            parts.append((is_decode, None if every else rows.to(device, non_blocking=True), table,
                          lens.to(device, non_blocking=True), cu_q.to(device, non_blocking=True)))
        return AttentionBatch(chunks, page_tables, parts)

    def __call__(self, batch: AttentionBatch, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        parts = batch.extra
        attn = None if len(parts) == 1 and parts[0][1] is None else torch.empty_like(q)
        for is_decode, rows, table, lens, cu_q in parts:
            q_rows = q if rows is None else q[rows]
            if is_decode:
                out = self._kernels.paged_decode_attention(q_rows, k_pool, v_pool, table, lens, scale=self.scale)
            else:
                out = self._kernels.paged_prefill_attention(q_rows, k_pool, v_pool, table, lens, cu_q,
                                                            scale=self.scale)
            if attn is None:
                return out
            attn[rows] = out
        return attn


@functools.cache
def triton_paged_attention() -> ModuleType | None:
    """``crescent.kernels.paged`` (the Triton kernels over Crescent's pool layout), where it and
    Triton import; None otherwise."""
    try:
        return importlib.import_module(TRITON_MODULE)
    except ImportError:
        return None


def triton_block_size_problem(block_size: int) -> str | None:
    """Why the CUDA attention kernels cannot take pages of ``block_size`` tokens (None: they can)."""
    if block_size % TRITON_BLOCK_MULTIPLE:
        return (f"the CUDA attention kernels (crescent.kernels.paged) take blocks of a multiple of "
                f"{TRITON_BLOCK_MULTIPLE} tokens")
    return None


def attention_for(cache_device: torch.device, cache_dtype: torch.dtype, compute_dtype: torch.dtype, *,
                  head_dim: int, group: int, scale: float) -> AttentionPath:
    """The attention path for a cache on ``cache_device`` in ``cache_dtype`` (see the module's docstring)."""
    if cache_device.type == "cpu":
        fits = head_dim == 64 and group <= 16 and cache_dtype == compute_dtype == torch.float32
        ops = paged_decode_ops() if fits else None
        return CpuKernelAttention(scale, ops) if ops is not None else TorchAttention(scale)
    if cache_device.type == "cuda" and (kernels := triton_paged_attention()) is not None:
        if head_dim <= TRITON_MAX_HEAD_DIM:
            return TritonAttention(scale, kernels)
        # A model property, not a setting: serve on the slower per-sequence path rather than fail.
        log.warning("attention on %s: head dim %d is over the Triton kernels' %d; the per-sequence torch path "
                    "serves instead (slower)", cache_device, head_dim, TRITON_MAX_HEAD_DIM)
    return TorchAttention(scale)
