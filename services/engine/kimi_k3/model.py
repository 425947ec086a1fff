"""The kimi_k3 hybrid decoder: KDA and gated MLA layers, SiTU-GLU FFN / latent MoE, Block AttnRes.

Each layer has two sublayers (attention, then FFN), each pre-normed. Block Attention Residuals
replace the residual sum: a sublayer's input is a softmax mix, with its own learned
pseudo-query, over the block representations so far — the embedding, each completed block's
sum of sublayer outputs and the current block's partial sum — and its output joins the partial
sum. The logits read a last mix (``model.final_res``) through the final norm. With AttnRes off
(``attn_res: false``, Kimi-Linear) a plain residual stream replaces the mixes: each sublayer
reads the running sum of the embedding and every earlier sublayer output.

Serves through ``Engine`` like ``LlamaModel``: ``forward(batch, cache, logits_for)`` over the
engine's flat variable-length ``ForwardBatch``, with the cache from ``make_cache``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from crescent.services.engine.kimi_k3.cache import K3Cache
from crescent.services.engine.kimi_k3.config import K3Config
from crescent.services.engine.kimi_k3.ffn import DenseFfn, LatentMoe, MoeWeights
from crescent.services.engine.kimi_k3.kda_layer import KdaLayer, KdaWeights
from crescent.services.engine.kimi_k3.memory import CacheFootprint, k3_footprint
from crescent.services.engine.kimi_k3.mla_layer import MlaLayer, MlaWeights
from crescent.services.engine.kimi_k3.ops import OpsBackend, K3Ops, linear, norm, select_backend, to_device
from crescent.services.engine.kimi_k3.snapshots import SnapshotPolicy
from crescent.services.engine.kimi_k3.weights import weight_shapes
from crescent.services.engine.llama import ForwardBatch


class K3Model:
    """Weights and the forward pass. Inference only; call under ``torch.inference_mode()``."""

    def __init__(self, config: K3Config, weights: dict[str, torch.Tensor], *, backend: OpsBackend | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 snapshots: SnapshotPolicy = SnapshotPolicy()) -> None:
        """``device``: where weights, cache and compute live (``EngineSettings.device``); the
        backend defaults to the Triton kernels on CUDA (``select_backend``). ``dtype``: of the
        float weights and activations (``EngineSettings.dtype``; ``model_dtype`` resolves
        "auto"); packed MXFP4 experts stay packed whatever it is, KDA states stay fp32.
        ``snapshots``: where the prefix cache keeps KDA state snapshots, and how many (``K3Cache``)."""
        expected = weight_shapes(config)
        missing = sorted(expected.keys() - weights.keys())
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {', '.join(missing[:5])}")
        unused = sorted(weights.keys() - expected.keys())
        if unused:  # a tensor this config does not compute with: the config and weights disagree
            raise ValueError(f"checkpoint has tensors this config does not use: {', '.join(unused[:5])}")
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
        self.config = config
        self.snapshot_policy = snapshots
        self.device = torch.device(device)
        self.dtype = dtype
        self.ops = K3Ops(backend or select_backend(self.device))
        w = {k: v.to(self.device, dtype).contiguous() for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else w["lm_head.weight"]
        self.norm = w["model.norm.weight"]
        self.attn, self.ffn, self.norms, self.mix = [], [], [], []
        kda_slot = mla_slot = 0
        for i, kind in enumerate(config.layer_types):
            p = f"model.layers.{i}."
            if kind == "kda":
                self.attn.append(KdaLayer(config, KdaWeights.take(config, w, p + "self_attn."), kda_slot, self.ops))
                kda_slot += 1
            else:
                self.attn.append(MlaLayer(config, MlaWeights.take(config, w, p + "self_attn."), mla_slot, self.ops))
                mla_slot += 1
            moe = config.is_moe_layer(i)
            self.ffn.append(LatentMoe(config, MoeWeights.take(config, w, p + "mlp."), self.ops) if moe else DenseFfn(config, w, p + "mlp."))
            self.norms += [w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"]]
            if config.attn_res:
                self.mix += [(w[p + f"{s}.query"], w[p + f"{s}.norm.weight"]) for s in ("attn_res", "mlp_res")]
        self.final_mix = (w["model.final_res.query"], w["model.final_res.norm.weight"]) if config.attn_res else None
        self._on_layer: Callable[[int], None] | None = None  # the current forward's (``forward``)

    # ---- what the engine asks of a model with its own cache layout ---------------------------

    def make_cache(self, num_pages: int, block_size: int) -> K3Cache:
        return K3Cache(self.config, num_pages, block_size, self.device, self.snapshot_policy)

    def footprint(self) -> CacheFootprint:
        return k3_footprint(self.config)

    def expert_load(self) -> torch.Tensor:
        """Tokens routed to each expert so far, ``[moe_layers, E]`` on the host (the expert-load
        metric: counted on the model's device, read here, between forwards)."""
        loads = [f.load for f in self.ffn if isinstance(f, LatentMoe)]
        return torch.stack(loads).cpu() if loads else torch.zeros((0, self.config.num_experts), dtype=torch.int64)

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch, cache: K3Cache, logits_for: list[int],
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run the batch, writing latents and state snapshots into ``cache``; logits of the last
        token of each chunk listed in ``logits_for``, ``(len(logits_for), vocab)``. ``on_layer(i)``
        is called once layer i's attention sublayer ran: its MLA latents (or its KDA state and
        the snapshots it leaves) for the batch are final."""
        cfg = self.config
        cache.plan_forward(batch)
        x = self.embed[to_device(batch.token_ids, self.device)]
        self._on_layer = on_layer
        try:
            h = self._attn_res_stack(x, batch, cache) if cfg.attn_res else self._residual_stack(x, batch, cache)
        finally:
            self._on_layer = None
        if not logits_for:
            return x.new_empty((0, cfg.vocab_size), dtype=torch.float32)
        ends = torch.cumsum(torch.tensor([c.num_new for c in batch.chunks]), 0) - 1
        rows = to_device(ends[torch.tensor(logits_for)], self.device)
        last = h(rows)
        # fp32 logits whatever the model's dtype: sampling compares them across instances
        return linear(norm(last, self.norm, cfg.rms_norm_eps), self.lm_head).float()

    def _sublayer(self, index: int, h: torch.Tensor, batch: ForwardBatch, cache: K3Cache) -> torch.Tensor:
        x = norm(h, self.norms[index], self.config.rms_norm_eps)
        layer = index // 2
        if index % 2:
            return self.ffn[layer].forward(x)
        out = self.attn[layer].forward(x, batch, cache)
        if self._on_layer is not None:
            cache.layer_written(layer)  # a fence on the compute stream: the hook's copies wait for it
            self._on_layer(layer)
        return out

    def _residual_stack(self, x: torch.Tensor, batch: ForwardBatch, cache: K3Cache):
        """Pre-norm residual stream; returns the final hidden rows as a function of row indices."""
        h = x
        for index in range(2 * self.config.num_layers):
            h = h + self._sublayer(index, h, batch, cache)
        return lambda rows: h[rows]

    def _attn_res_stack(self, x: torch.Tensor, batch: ForwardBatch, cache: K3Cache):
        """Block AttnRes; returns the final mix of the chosen rows as a function of row indices."""
        eps = self.config.rms_norm_eps
        per_block = self.config.sublayers_per_block
        blocks = [x]
        partial: torch.Tensor | None = None
        done = 0
        for index in range(2 * self.config.num_layers):
            sources = blocks if partial is None else [*blocks, partial]
            query, key_norm = self.mix[index]
            y = self._sublayer(index, self.ops.attn_res(torch.stack(sources), query, key_norm, eps), batch, cache)
            partial = y if partial is None else partial + y
            done += 1
            if done == per_block:
                blocks.append(partial)
                partial, done = None, 0
        final = blocks if partial is None else [*blocks, partial]
        assert self.final_mix is not None
        return lambda rows: self.ops.attn_res(torch.stack([s[rows] for s in final]), *self.final_mix, eps)
