"""A worker of a tensor-parallel instance: ``crescent serve <role>-worker`` (a LeaderWorkerSet's
worker pods), or ``python -m crescent.services.engine.parallel.worker <role> [config]``.

It reads the role's own settings (the same YAML file and env vars as the leader), loads the
same checkpoint, keeps its shard, and then only executes the leader's commands: allocate the
cache, forward a batch, read or write its KV heads of a block, shut down. It serves nothing,
registers nothing, and exits when the leader says so (0) or is gone (``EXIT_GROUP_BROKEN``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from crescent.services.common.logs import configure_logging
from crescent.services.common.settings import load_settings
from crescent.services.contract.roles import ENGINE_ROLES, settings_class, settings_module
from crescent.services.engine.kv_cache import PagedKvCache
from crescent.services.engine.llama import LlamaModel
from crescent.services.engine.loader import load_model
from crescent.services.engine.parallel.batch_wire import decode_batch
from crescent.services.engine.parallel.group import Command, TpGroup
from crescent.services.engine.parallel.leader import check_same_model, check_shardable, shard_model
from crescent.services.engine.parallel.settings import GroupSettingsError
from crescent.services.engine.settings import EngineSettings
from crescent.services.model.model_source import resolve_model

log = logging.getLogger(__name__)



class ShardWorker:
    """Executes the leader's commands on this rank's shard until shutdown."""

    def __init__(self, model: LlamaModel, group: TpGroup) -> None:
        self.model = model
        self.group = group
        self.cache: PagedKvCache | None = None

    def serve(self) -> None:
        while True:
            command, args = self.group.next_command()
            if command is Command.SHUTDOWN:
                log.info("the leader shut the group down")
                self.group.close()
                return
            if command is not Command.PING:
                self._run(command, args)

    def _run(self, command: Command, args: list[int]) -> None:
        cfg = self.model.config
        if command is Command.CACHE:
            self.cache = PagedKvCache(args[0], cfg.num_layers, args[1], self.model.kv_heads, cfg.head_dim)
            log.info("KV cache: %d pages of %d tokens, %d KV heads (%.2f GB)", args[0], args[1], self.model.kv_heads,
                     self.cache.nbytes() / 1e9)
            return
        cache = self.cache
        if cache is None:
            raise RuntimeError(f"the leader sent {command.name} before allocating the KV cache")
        if command is Command.FORWARD:
            flat = torch.empty(args[0], dtype=torch.int64)
            self.group.broadcast(flat)
            with torch.inference_mode():
                self.model.forward(decode_batch(flat), cache, [])
        elif command is Command.READ:
            page, tokens = args[0], args[1]
            self.group.gather(cache.read_block(page, tokens).contiguous())
        elif command is Command.WRITE:
            page, tokens = args[0], args[1]
            mine = torch.empty(cache.payload_shape(tokens), dtype=cache.wire_dtype)
            self.group.scatter(mine, None)
            cache.write_block(page, mine)


def run_worker(engine: EngineSettings) -> None:
    """Load this rank's shard of ``engine.model``, join the group and serve the leader."""
    torch.set_num_threads(engine.threads)
    spec = engine.parallel.resolve()
    spec.check_worker()
    source = resolve_model(engine.model)
    if source.kind == "kimi_k3":
        raise GroupSettingsError("engine.parallel: tensor parallelism covers Llama-family models; "
                                 f"{engine.model!r} is a kimi_k3 model (expert parallelism is not built)")
    loaded = load_model(source, progress=False)
    check_shardable(loaded.config, spec)
    group = TpGroup(spec)
    group.join()
    check_same_model(group, loaded.config, loaded.weights)
    model = shard_model(loaded.config, loaded.weights, group)
    del loaded
    log.info("tensor-parallel worker rank %d of %d ready: %d of %d KV heads", spec.rank, spec.size, model.kv_heads,
             model.config.num_kv_heads)
    ShardWorker(model, group).serve()


def main(role: str, config_path: Path | None = None) -> None:
    """Read ``role``'s settings and run as a worker of its engine group."""
    if role not in ENGINE_ROLES:
        raise GroupSettingsError(f"unknown role {role!r} for a worker; valid: {', '.join(ENGINE_ROLES)}")
    configure_logging(f"{role}-worker")
    settings = load_settings(settings_class(role), config_path, env_prefix=settings_module(role).ENV_PREFIX)
    run_worker(settings.engine)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else None)
