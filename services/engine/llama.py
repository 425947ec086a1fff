"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral without sliding window) over a paged KV cache.

One forward pass takes a flat, variable-length batch: a prefill chunk of one sequence, one new
token for each of many decoding sequences, or a mix. Linear layers run on the whole flat batch;
attention runs per sequence over its pages (``attention.py`` picks the path by the cache's device).

Weights, activations and the cache live on ``device`` in ``dtype`` (engine.device, engine.dtype);
the batch's index tensors are built on the host and moved once per forward. Norms are computed
in float32 whatever the dtype (``dense_ops.norm``), RoPE in the activations' dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from crescent.kernels.cpu import InvariantLinear, apply_rope, rope_tables, silu_and_mul
from crescent.services.engine.attention import AttentionPath, attention_for
from crescent.services.engine.dense_ops import DeviceLinear, make_linear, norm
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
    def build(chunks: list[tuple[SeqChunk, list[int]]], block_size: int) -> ForwardBatch:
        """From (chunk, its new token ids) pairs."""
        positions = []
        for chunk, new_ids in chunks:
            assert len(new_ids) == chunk.num_new
            positions.extend(range(chunk.context_len - chunk.num_new, chunk.context_len))
        pos = torch.tensor(positions, dtype=torch.int64)
        pages = torch.tensor(
            [c.pages[p // block_size] for c, _ in chunks for p in range(c.context_len - c.num_new, c.context_len)],
            dtype=torch.int64,
        )
        return ForwardBatch(
            token_ids=torch.tensor([t for _, ids in chunks for t in ids], dtype=torch.int64),
            positions=pos,
            slot_pages=pages,
            slot_offsets=pos % block_size,
            chunks=tuple(c for c, _ in chunks),
        )


Linear = InvariantLinear | DeviceLinear


@dataclass(frozen=True, slots=True)
class _LayerWeights:
    input_norm: torch.Tensor  # float32
    qkv: Linear               # q, k and v projections stacked: one GEMM instead of three
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear           # gate and up stacked
    down: Linear


class LlamaModel:
    """Weights and the forward pass. Inference only; call under ``torch.inference_mode()``.

    A tensor-parallel shard (``services/engine/parallel``) passes weights already sliced to its
    ``kv_heads`` (q/k/v rows of those KV-head groups, o_proj columns, a slice of the MLP) and a
    ``reduce`` that sums a partial output across the group (after o_proj and down_proj); it then
    keeps only its KV heads in ``cache``. Embedding and norms are whole on every rank; a worker
    rank never computes logits, so it is built ``with_lm_head=False``.
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], *, kv_heads: int | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, with_lm_head: bool = True,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.device, self.dtype = torch.device(device), dtype
        self.kv_heads = config.num_kv_heads if kv_heads is None else kv_heads  # held by this process
        self.heads = self.kv_heads * (config.num_heads // config.num_kv_heads)
        self._reduce = reduce
        w = weights

        def take(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
            try:
                tensor = w[name]
            except KeyError:
                raise ValueError(f"checkpoint has no tensor {name!r}") from None
            return tensor.to(device=self.device, dtype=as_dtype).contiguous()

        def stacked(*names: str) -> Linear:
            return make_linear(torch.cat([take(n) for n in names]))

        self.embed = take("model.embed_tokens.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                _LayerWeights(
                    input_norm=take(p + "input_layernorm.weight", torch.float32),
                    qkv=stacked(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                    o=make_linear(take(p + "self_attn.o_proj.weight")),
                    post_norm=take(p + "post_attention_layernorm.weight", torch.float32),
                    gate_up=stacked(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=make_linear(take(p + "mlp.down_proj.weight")),
                )
            )
        self.norm = take("model.norm.weight", torch.float32)
        tied = config.tie_word_embeddings or "lm_head.weight" not in w
        self.lm_head = (make_linear(self.embed if tied else take("lm_head.weight")) if with_lm_head
                        else None)  # (a reordered copy of the weight even when tied, on the CPU)
        cos, sin = rope_tables(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.cos, self.sin = cos.to(self.device, dtype), sin.to(self.device, dtype)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self._q_width = self.heads * config.head_dim
        self._kv_width = self.kv_heads * config.head_dim
        self._attention: dict[tuple[torch.device, torch.dtype], AttentionPath] = {}

    def attention_path(self, cache: PagedKvCache) -> AttentionPath:
        """The attention path for ``cache`` (by its device and dtype; see ``attention.py``)."""
        key = (cache.pool.device, cache.pool.dtype)
        path = self._attention.get(key)
        if path is None:
            cfg = self.config
            path = self._attention[key] = attention_for(
                cache.pool.device, cache.pool.dtype, self.dtype, head_dim=cfg.head_dim,
                group=cfg.num_heads // cfg.num_kv_heads, scale=self.scale)
        return path

    def forward(self, batch: ForwardBatch, cache: PagedKvCache, logits_for: list[int],
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run the batch, writing its KV into ``cache``; return logits (len(logits_for), vocab).

        ``logits_for`` lists chunk indices whose last token's logits are wanted. ``on_layer(i)``
        is called once layer i's K and V of the batch are in the cache (they change no more in
        this forward): a layer-wise handoff sends them while later layers compute. On a GPU they
        are queued, not done, then: ``cache.copy_layer`` waits for the layer's fence.
        """
        cfg = self.config
        n = batch.token_ids.shape[0]
        device = self.device
        positions = batch.positions.to(device, non_blocking=True)
        slot_pages = batch.slot_pages.to(device, non_blocking=True)
        slot_offsets = batch.slot_offsets.to(device, non_blocking=True)
        cos, sin = self.cos[positions], self.sin[positions]
        block_size = cache.block_size
        page_tables = [
            torch.tensor(c.pages[: -(-c.context_len // block_size)], dtype=torch.int64).to(device, non_blocking=True)
            for c in batch.chunks
        ]
        attention = self.attention_path(cache)
        attend = attention.prepare(batch.chunks, page_tables)
        h = self.embed[batch.token_ids.to(device, non_blocking=True)]
        for index, layer in enumerate(self.layers):
            x = norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(x)
            q = qkv[:, : self._q_width].view(n, self.heads, cfg.head_dim)
            k = qkv[:, self._q_width : self._q_width + self._kv_width].view(n, self.kv_heads, cfg.head_dim)
            v = qkv[:, self._q_width + self._kv_width :].view(n, self.kv_heads, cfg.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            layer_pool = cache.pool[:, index]
            layer_pool[:, 0][slot_pages, slot_offsets] = k.to(layer_pool.dtype)
            layer_pool[:, 1][slot_pages, slot_offsets] = v.to(layer_pool.dtype)
            if on_layer is not None:
                cache.layer_written(index)  # a fence on the compute stream: the hook's copies wait for it
                on_layer(index)
            attn = attention(attend, q, layer_pool[:, 0], layer_pool[:, 1])
            h = h + self._summed(layer.o(attn.view(n, -1)))
            x = norm(h, layer.post_norm, cfg.rms_norm_eps)
            h = h + self._summed(layer.down(silu_and_mul(layer.gate_up(x))))
        if not logits_for:
            return h.new_empty((0, cfg.vocab_size))
        assert self.lm_head is not None, "logits asked of a model built without lm_head"
        ends = torch.cumsum(torch.tensor([c.num_new for c in batch.chunks]), 0) - 1
        last = h[ends[torch.tensor(logits_for)].to(device, non_blocking=True)]
        return self.lm_head(norm(last, self.norm, cfg.rms_norm_eps))

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A shard's partial projection summed over the group (itself when there is no group)."""
        return partial if self._reduce is None else self._reduce(partial)
