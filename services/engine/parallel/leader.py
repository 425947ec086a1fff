"""The leader's model: its own shard, driving the workers' shards through the group.

The leader is the instance's normal serving process (prefill, decode or aggregated); its
``Engine`` gets a ``TensorParallelLlama`` and never knows. Each forward broadcasts the batch
(``batch_wire``) and then runs the leader's shard; the workers run theirs on the same batch,
and the all-reduces inside the forward meet.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable

import torch

from crescent.services.engine.kv_cache import PagedKvCache
from crescent.services.engine.llama import ForwardBatch, LlamaModel
from crescent.services.engine.model_config import LlamaConfig
from crescent.services.engine.parallel.batch_wire import encode_batch
from crescent.services.engine.parallel.group import Command, TpGroup
from crescent.services.engine.parallel.kv_cache import ShardedKvCache
from crescent.services.engine.parallel.shard import shard_shape, shard_weights
from crescent.services.engine.parallel.settings import GroupSettingsError, GroupSpec

log = logging.getLogger(__name__)


class TensorParallelLlama:
    """What ``Engine`` needs of a model (``config``, ``forward``, ``make_cache``), computed by a group."""

    def __init__(self, shard: LlamaModel, group: TpGroup) -> None:
        self.shard = shard
        self.group = group
        self.config = shard.config
        self.group_size = group.size

    def make_cache(self, num_pages: int, block_size: int) -> ShardedKvCache:
        """Every rank allocates its KV heads of ``num_pages`` pages (the leader's numbers, so they agree)."""
        cfg = self.config
        with self.group.command(Command.CACHE, num_pages, block_size):
            local = PagedKvCache(num_pages, cfg.num_layers, block_size, self.shard.kv_heads, cfg.head_dim)
        return ShardedKvCache(local, self.group, cfg.num_kv_heads)

    def forward(self, batch: ForwardBatch, cache: ShardedKvCache, logits_for: list[int],
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        flat = encode_batch(batch)
        with self.group.command(Command.FORWARD, flat.numel()):
            self.group.broadcast(flat)
            return self.shard.forward(batch, cache.local, logits_for, on_layer)


def shard_model(config: LlamaConfig, weights: dict[str, torch.Tensor], group: TpGroup) -> LlamaModel:
    """This rank's shard of the checkpoint, its partial sums reduced over ``group``."""
    shape = shard_shape(config, group.rank, group.size)
    return LlamaModel(config, shard_weights(config, weights, shape), kv_heads=shape.kv_heads, reduce=group.all_reduce,
                      with_lm_head=group.rank == 0)  # only the leader computes logits


def check_shardable(config: LlamaConfig, spec: GroupSpec) -> None:
    """Before anyone waits for anyone: GroupSettingsError when the model does not split ``spec.size`` ways."""
    try:
        shard_shape(config, spec.rank, spec.size)
    except ValueError as exc:
        raise GroupSettingsError(f"engine.parallel.group_size {spec.size}: {exc}") from None


def check_same_model(group: TpGroup, config: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
    """Every rank compares the model's shape and a checksum of its replicated weights with the
    others'; ValueError on every rank, naming what differs, when they did not load the same model."""
    embed = weights["model.embed_tokens.weight"].double().sum()
    fields = {"num_layers": config.num_layers, "hidden_size": config.hidden_size, "num_heads": config.num_heads,
              "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "vocab_size": config.vocab_size,
              "intermediate_size": config.intermediate_size,
              "embedding checksum": int(torch.tensor([float(embed)], dtype=torch.float64).view(torch.int64))}
    mine = torch.tensor(list(fields.values()), dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(group.size)]
    group.all_gather(parts, mine)
    for rank, theirs in enumerate(parts):
        differ = [name for name, a, b in zip(fields, mine.tolist(), theirs.tolist()) if a != b]
        if differ:
            raise ValueError(f"tensor-parallel rank {rank} loaded another model than rank {group.rank}: "
                             f"{', '.join(differ)} differ; every process of the group must load the same checkpoint")


def leader_model(config: LlamaConfig, weights: dict[str, torch.Tensor], spec: GroupSpec) -> TensorParallelLlama:
    """Join the group as its leader and build the instance's model (the workers join with ``worker.serve``)."""
    spec.check_leader()
    check_shardable(config, spec)
    group = TpGroup(spec)
    group.join()
    atexit.register(group.close)  # a clean exit lets the workers exit 0 too
    check_same_model(group, config, weights)
    model = TensorParallelLlama(shard_model(config, weights, group), group)
    group.start_pinging()  # from here on, every collective is inside a command
    log.info("tensor parallel over %d processes: this leader holds %d of %d KV heads", spec.size,
             model.shard.kv_heads, config.num_kv_heads)
    return model
