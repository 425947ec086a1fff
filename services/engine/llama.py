"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral without sliding window) over a paged KV cache.

One forward pass takes a flat, variable-length batch: a prefill chunk of one sequence, one new
token for each of many decoding sequences, or a mix. Linear layers run on the whole flat batch;
attention runs per sequence over its pages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from crescent.kernels.cpu import InvariantLinear, apply_rope, paged_attention, rms_norm, rope_tables, silu_and_mul
from crescent.kernels.cpu.cpu_ext import paged_decode_ops
from crescent.services.engine.kv_cache import PagedKvCache
from crescent.services.engine.model_config import LlamaConfig


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a forward batch: ``num_new`` tokens ending at ``context_len``."""

    pages: tuple[int, ...]  # the sequence's page table, covering at least context_len tokens
    context_len: int
    num_new: int
    state: int = -1         # models with a recurrent state (kimi_k3): the sequence's live state in the cache
    prompt_tokens: int = 0  # ... and its prompt, whose full blocks may keep state snapshots (0: none)


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    token_ids: torch.Tensor   # (tokens,) int64, the chunks' new tokens back to back
    positions: torch.Tensor   # (tokens,) int64
    slot_pages: torch.Tensor  # (tokens,) page each new token's KV goes to
    slot_offsets: torch.Tensor  # (tokens,) offset within that page
    chunks: tuple[SeqChunk, ...]

    @staticmethod
    def build(chunks: list[tuple[SeqChunk, list[int]]], page_size: int) -> ForwardBatch:
        """From (chunk, its new token ids) pairs."""
        positions = []
        for chunk, new_ids in chunks:
            assert len(new_ids) == chunk.num_new
            positions.extend(range(chunk.context_len - chunk.num_new, chunk.context_len))
        pos = torch.tensor(positions, dtype=torch.int64)
        pages = torch.tensor(
            [c.pages[p // page_size] for c, _ in chunks for p in range(c.context_len - c.num_new, c.context_len)],
            dtype=torch.int64,
        )
        return ForwardBatch(
            token_ids=torch.tensor([t for _, ids in chunks for t in ids], dtype=torch.int64),
            positions=pos,
            slot_pages=pages,
            slot_offsets=pos % page_size,
            chunks=tuple(c for c, _ in chunks),
        )


@dataclass(frozen=True, slots=True)
class _LayerWeights:
    input_norm: torch.Tensor
    qkv: InvariantLinear      # q, k and v projections stacked: one GEMM instead of three
    o: InvariantLinear
    post_norm: torch.Tensor
    gate_up: InvariantLinear  # gate and up stacked
    down: InvariantLinear


class LlamaModel:
    """Weights and the forward pass. Inference only; call under ``torch.inference_mode()``.

    A tensor-parallel shard (``services/engine/parallel``) passes weights already sliced to its
    ``kv_heads`` (q/k/v rows of those KV-head groups, o_proj columns, a slice of the MLP) and a
    ``reduce`` that sums a partial output across the group (after o_proj and down_proj); it then
    keeps only its KV heads in ``cache``. Embedding and norms are whole on every rank; a worker
    rank never computes logits, so it is built ``with_lm_head=False``.
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], *, kv_heads: int | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, with_lm_head: bool = True) -> None:
        self.config = config
        self.kv_heads = config.num_kv_heads if kv_heads is None else kv_heads  # held by this process
        self.heads = self.kv_heads * (config.num_heads // config.num_kv_heads)
        self._reduce = reduce
        w = weights

        def take(name: str) -> torch.Tensor:
            try:
                return w[name].float().contiguous()
            except KeyError:
                raise ValueError(f"checkpoint has no tensor {name!r}") from None

        self.embed = take("model.embed_tokens.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                _LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=InvariantLinear(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])),
                    o=InvariantLinear(take(p + "self_attn.o_proj.weight")),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=InvariantLinear(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                    down=InvariantLinear(take(p + "mlp.down_proj.weight")),
                )
            )
        self.norm = take("model.norm.weight")
        tied = config.tie_word_embeddings or "lm_head.weight" not in w
        self.lm_head = (InvariantLinear(self.embed if tied else take("lm_head.weight")) if with_lm_head
                        else None)  # (a reordered copy of the weight even when tied)
        self.cos, self.sin = rope_tables(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self._q_width = self.heads * config.head_dim
        self._kv_width = self.kv_heads * config.head_dim
        # Decode rows (one new token) attend through the C++ op over the pages, where it applies.
        kernel_fits = config.head_dim == 64 and config.num_heads // config.num_kv_heads <= 16
        self._decode_ops = paged_decode_ops() if kernel_fits else None

    def forward(self, batch: ForwardBatch, cache: PagedKvCache, logits_for: list[int],
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run the batch, writing its KV into ``cache``; return logits (len(logits_for), vocab).

        ``logits_for`` lists chunk indices whose last token's logits are wanted. ``on_layer(i)``
        is called once layer i's K and V of the batch are in the cache (they change no more in
        this forward): a layer-wise handoff sends them while later layers compute.
        """
        cfg = self.config
        n = batch.token_ids.shape[0]
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        page_size = cache.page_size
        page_tables = [
            torch.tensor(c.pages[: -(-c.context_len // page_size)], dtype=torch.int64) for c in batch.chunks
        ]
        decode = self._decode_rows(batch, page_tables, cache)
        h = self.embed[batch.token_ids]
        for index, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(x)
            q = qkv[:, : self._q_width].view(n, self.heads, cfg.head_dim)
            k = qkv[:, self._q_width : self._q_width + self._kv_width].view(n, self.kv_heads, cfg.head_dim)
            v = qkv[:, self._q_width + self._kv_width :].view(n, self.kv_heads, cfg.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            layer_pool = cache.pool[:, index]
            layer_pool[:, 0][batch.slot_pages, batch.slot_offsets] = k
            layer_pool[:, 1][batch.slot_pages, batch.slot_offsets] = v
            if on_layer is not None:
                on_layer(index)
            attn = torch.empty_like(q)
            if decode is not None:
                rows, tables, lens = decode
                q_rows = q if rows is None else q[rows]
                out = self._decode_ops.paged_decode_attention(q_rows, layer_pool[:, 0], layer_pool[:, 1], tables,
                                                              lens, self.scale)
                if rows is None:
                    attn = out
                else:
                    attn[rows] = out
            start = 0
            for chunk, table in zip(batch.chunks, page_tables):
                end = start + chunk.num_new
                if decode is not None and chunk.num_new == 1:
                    start = end
                    continue
                # index_select, not layer_pool[table]: the same copy at half the cost. K and V
                # apart, so each is one contiguous copy that attention takes as a view.
                k_pages = torch.index_select(layer_pool[:, 0], 0, table)
                v_pages = torch.index_select(layer_pool[:, 1], 0, table)
                attn[start:end] = paged_attention(q[start:end], k_pages, v_pages, chunk.context_len, self.scale)
                start = end
            h = h + self._summed(layer.o(attn.view(n, -1)))
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            h = h + self._summed(layer.down(silu_and_mul(layer.gate_up(x))))
        if not logits_for:
            return h.new_empty((0, cfg.vocab_size))
        assert self.lm_head is not None, "logits asked of a model built without lm_head"
        ends = torch.cumsum(torch.tensor([c.num_new for c in batch.chunks]), 0) - 1
        last = h[ends[torch.tensor(logits_for)]]
        return self.lm_head(rms_norm(last, self.norm, cfg.rms_norm_eps))

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A shard's partial projection summed over the group (itself when there is no group)."""
        return partial if self._reduce is None else self._reduce(partial)

    def _decode_rows(self, batch: ForwardBatch, page_tables: list[torch.Tensor],
                     cache: PagedKvCache) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
        """(flat rows or None for all, padded page tables, context lengths) of the batch's decode
        rows for the C++ op; None when it does not apply (no op, no decode row, not an fp32 cache)."""
        if self._decode_ops is None or cache.pool.dtype != torch.float32:
            return None
        picked = [i for i, c in enumerate(batch.chunks) if c.num_new == 1]
        if not picked:
            return None
        widest = max(page_tables[i].numel() for i in picked)
        tables = torch.zeros((len(picked), widest), dtype=torch.int64)
        for row, i in enumerate(picked):
            tables[row, : page_tables[i].numel()] = page_tables[i]
        lens = torch.tensor([batch.chunks[i].context_len for i in picked], dtype=torch.int64)
        if len(picked) == len(batch.chunks) == batch.token_ids.shape[0]:
            return None, tables, lens  # a pure decode step: every row
        offsets = torch.cumsum(torch.tensor([0] + [c.num_new for c in batch.chunks[:-1]]), 0)
        return offsets[picked], tables, lens
