"""A rank's share of a Llama checkpoint (Megatron-style tensor parallelism).

Rank r of a group of s holds KV heads ``[r*kv/s, (r+1)*kv/s)`` and the query heads that attend
to them (a GQA group stays on one rank), so q/k/v are sliced by rows and o_proj by columns; the
MLP's gate/up rows and down_proj columns by ``intermediate_size / s``. Each rank's o_proj and
down_proj give a partial sum of the full output: one all-reduce after each. Embedding and norms
are replicated; lm_head lives on the leader only (``leader.shard_model``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crescent.services.engine.model_config import LlamaConfig


@dataclass(frozen=True, slots=True)
class ShardShape:
    """What one rank of a group of ``size`` holds."""

    rank: int
    size: int
    kv_heads: int          # KV heads per rank
    heads: int             # query heads per rank
    intermediate: int      # MLP width per rank


def shard_shape(config: LlamaConfig, rank: int, size: int) -> ShardShape:
    """Raises ValueError naming the numbers when the model does not split ``size`` ways."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of {size}")
    if config.num_kv_heads % size:
        raise ValueError(f"a tensor-parallel group of {size} needs num_kv_heads ({config.num_kv_heads}) divisible "
                         f"by {size}: each rank holds whole KV heads; use a group size that divides it")
    if config.intermediate_size % size:
        raise ValueError(f"a tensor-parallel group of {size} needs intermediate_size ({config.intermediate_size}) "
                         f"divisible by {size}")
    kv = config.num_kv_heads // size
    return ShardShape(rank, size, kv, kv * (config.num_heads // config.num_kv_heads), config.intermediate_size // size)


def shard_weights(config: LlamaConfig, weights: dict[str, torch.Tensor], shape: ShardShape) -> dict[str, torch.Tensor]:
    """The rank's weights under the checkpoint's names (sliced copies; whole ones shared)."""
    d, r = config.head_dim, shape.rank
    q_rows = slice(r * shape.heads * d, (r + 1) * shape.heads * d)
    kv_rows = slice(r * shape.kv_heads * d, (r + 1) * shape.kv_heads * d)
    mlp = slice(r * shape.intermediate, (r + 1) * shape.intermediate)
    by_suffix = {
        "self_attn.q_proj.weight": lambda t: t[q_rows],
        "self_attn.k_proj.weight": lambda t: t[kv_rows],
        "self_attn.v_proj.weight": lambda t: t[kv_rows],
        "self_attn.o_proj.weight": lambda t: t[:, q_rows],
        "mlp.gate_proj.weight": lambda t: t[mlp],
        "mlp.up_proj.weight": lambda t: t[mlp],
        "mlp.down_proj.weight": lambda t: t[:, mlp],
    }
    out = {}
    for name, tensor in weights.items():
        cut = next((fn for suffix, fn in by_suffix.items() if name.endswith(suffix)), None)
        out[name] = tensor if cut is None else cut(tensor).contiguous()
    return out
