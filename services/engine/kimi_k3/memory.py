"""Memory accounting of a hybrid model's cache: what a cached token, a sequence and a snapshot cost.

MLA layers keep, per token, the latent c_kv (``kv_lora_rank``) and the decoupled key
(``qk_rope_head_dim``), in the cache dtype: the only per-token cache. KDA layers keep a
fixed-size state — the ``HV x K x V`` recurrent state (fp32) and the last ``W - 1`` inputs of the
q/k/v short convolutions — once per *running sequence* (all fp32: a live tail is rounded only at
block boundaries), plus the prefix cache's state snapshots, a bounded pool of
``snapshot_slots`` taken sparsely at block boundaries (fp32 states, tails in the cache dtype, bf16 under fp8;
``K3Cache``). So the whole cache is

    cache_bytes = pages x block_size x kv_bytes_per_token
                + running sequences x state_bytes_per_sequence
                + snapshot_slots x snapshot_bytes_per_block

which is what ``K3Cache`` allocates (tests/engine/test_kimi_k3_snapshots.py checks it byte for
byte) and what docs/k3.md's memory section states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from crescent.services.engine.kimi_k3.config import K3Config

if TYPE_CHECKING:
    import torch  # imported where a dtype is asked for: `crescent plan` and the CLI load without torch


def cache_torch_dtype(cfg: K3Config) -> torch.dtype:
    """The torch dtype of cached MLA latents (``cfg.cache_dtype``)."""
    import torch

    return getattr(torch, cfg.cache_dtype)


def tail_torch_dtype(cfg: K3Config) -> torch.dtype:
    """The torch dtype of snapshot conv tails: the cache dtype, but bf16 under an fp8 latent cache
    (as vLLM's ``kv_cache_dtype=fp8`` covers attention layers only, never a linear layer's state:
    a 3-bit mantissa tail would change every later token of a resumed sequence)."""
    import torch

    dtype = cache_torch_dtype(cfg)
    return torch.bfloat16 if dtype.itemsize == 1 else dtype


@dataclass(frozen=True, slots=True)
class CacheFootprint:
    kv_bytes_per_token: int        # MLA latents of one token, all MLA layers
    state_bytes_per_sequence: int  # KDA recurrent states + conv tails (fp32), all KDA layers: one live state
    snapshot_bytes_per_block: int  # one state snapshot (tails in the cache dtype), kept only at chosen blocks

    def cache_bytes(self, tokens: int, sequences: int, snapshots: int) -> int:
        """Bytes of a cache holding ``tokens`` token slots, ``sequences`` running sequences and a
        pool of ``snapshots`` state snapshots."""
        return (tokens * self.kv_bytes_per_token + sequences * self.state_bytes_per_sequence
                + snapshots * self.snapshot_bytes_per_block)

    def bytes_per_cached_token(self, tokens: int, snapshots: int) -> float:
        """Bytes per cached token of a prefix cache of ``tokens`` tokens and ``snapshots`` snapshots."""
        return self.cache_bytes(tokens, 0, snapshots) / tokens


def k3_footprint(cfg: K3Config, *, kv_dtype_bytes: int | None = None, tail_dtype_bytes: int | None = None,
                 state_dtype_bytes: int = 4) -> CacheFootprint:
    """The cache footprint of ``cfg``. ``kv_dtype_bytes``: bytes of a cached latent element
    (default: the config's ``cache_dtype``); ``tail_dtype_bytes``: of a snapshot conv-tail element
    (default: ``tail_torch_dtype``; with ``kv_dtype_bytes`` given and this not, the same);
    ``state_dtype_bytes``: of a KDA state element and of a live conv-tail element (the kernels
    keep states in fp32)."""
    if tail_dtype_bytes is None:
        tail_dtype_bytes = tail_torch_dtype(cfg).itemsize if kv_dtype_bytes is None else max(kv_dtype_bytes, 2)
    if kv_dtype_bytes is None:
        kv_dtype_bytes = cache_torch_dtype(cfg).itemsize
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    kv = n_mla * cfg.mla_latent_dim * kv_dtype_bytes
    state = n_kda * cfg.kda_num_v_heads * cfg.kda_head_dim * cfg.kda_v_head_dim * state_dtype_bytes
    conv = n_kda * cfg.kda_conv_dim * (cfg.kda_conv_width - 1)
    return CacheFootprint(kv_bytes_per_token=kv, state_bytes_per_sequence=state + conv * state_dtype_bytes,
                          snapshot_bytes_per_block=state + conv * tail_dtype_bytes)


def dense_gqa_kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """K and V of one token in a dense grouped-query-attention model, all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes
