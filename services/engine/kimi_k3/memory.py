"""Memory accounting of a hybrid model's cache: what a cached token and a sequence cost.

MLA layers keep, per token, the latent c_kv (``kv_lora_rank``) and the decoupled RoPE key
(``qk_rope_head_dim``): the only per-token cache. KDA layers keep a fixed-size state per
sequence — the ``HV x K x V`` recurrent state and the last ``W - 1`` inputs of the q/k/v short
convolutions — and state-aware prefix caching stores one such snapshot in every block, so a
cached block costs ``block_size * kv_bytes_per_token + snapshot_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

from crescent.services.engine.kimi_k3.config import K3Config


@dataclass(frozen=True, slots=True)
class CacheFootprint:
    kv_bytes_per_token: int        # MLA latents of one token, all MLA layers
    state_bytes_per_sequence: int  # KDA recurrent states + conv tails, all KDA layers
    snapshot_bytes_per_block: int  # what every cached block carries besides its tokens' latents

    def block_bytes(self, block_size: int) -> int:
        return block_size * self.kv_bytes_per_token + self.snapshot_bytes_per_block

    def bytes_per_cached_token(self, block_size: int) -> float:
        """Bytes the prefix cache spends per cached token, snapshots amortised over the block."""
        return self.block_bytes(block_size) / block_size


def k3_footprint(cfg: K3Config, *, kv_dtype_bytes: int = 4, state_dtype_bytes: int = 4) -> CacheFootprint:
    """The cache footprint of ``cfg``; the engine stores everything in fp32 (4 bytes)."""
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    kv = n_mla * cfg.mla_latent_dim * kv_dtype_bytes
    state = n_kda * cfg.kda_num_v_heads * cfg.kda_head_dim * cfg.kda_v_head_dim * state_dtype_bytes
    conv = n_kda * cfg.kda_conv_dim * (cfg.kda_conv_width - 1) * kv_dtype_bytes
    return CacheFootprint(kv_bytes_per_token=kv, state_bytes_per_sequence=state + conv, snapshot_bytes_per_block=state + conv)


def dense_gqa_kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """K and V of one token in a dense grouped-query-attention model, all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes
