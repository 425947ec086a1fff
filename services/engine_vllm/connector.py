"""``CrescentConnector``: Crescent's KV cache plugged into vLLM through its KV connector
interface (``KVConnectorBase_V1``, loaded by module path: ``kv_connector_module_path:
crescent.services.engine_vllm.connector``), as Mooncake's, NIXL's and LMCache's connectors are.

vLLM builds one in its scheduler (role SCHEDULER) and one in each worker (role WORKER); the
halves live in ``connector_scheduler.py`` and ``connector_worker.py``. Both reach the node's
kvstore through Crescent's own client (every byte mover, CRC-checked blocks in Crescent's
format under Crescent's salted keys), so blocks a vLLM instance stores are blocks a native
instance of the same model can load, and the other way round, where vLLM's attention layout converts
to the native one (``kv_layout.py``).

It supports vLLM's hybrid memory allocator (``SupportsHMA``): a hybrid model's attention groups
travel as blocks and its recurrent-state groups as sparse snapshots beside them
(``hybrid_layout.py``); a model whose groups it cannot name (sliding window, ...) is served with
the connector passive.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from crescent.services.engine_vllm.connector_metadata import CrescentConnectorMetadata
from crescent.services.engine_vllm.connector_options import ConnectorOptions
from crescent.services.engine_vllm.connector_scheduler import ConnectorScheduler
from crescent.services.engine_vllm.connector_worker import ConnectorWorker
from crescent.services.engine_vllm.hybrid_layout import group_layout, state_format
from crescent.services.engine_vllm.kv_layout import attention_layout
from crescent.services.engine_vllm.store_link import StoreLink

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class CrescentConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        options = ConnectorOptions.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        if vllm_config.cache_config.block_size != options.block_size:
            raise ValueError(f"CrescentConnector: vLLM's block_size {vllm_config.cache_config.block_size} is not "
                             f"Crescent's {options.block_size}; blocks must be the same tokens")
        groups = group_layout(kv_cache_config)
        if groups.unsupported:
            log.warning("Crescent connector passive (no kvstore lookups or saves) for this model's KV cache groups: %s",
                        groups.unsupported)
        link = StoreLink(options) if options.kvstore_address and groups.carried else None
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(options, link, groups, state_format(kv_cache_config, groups))
        else:
            num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
            self._worker = ConnectorWorker(options, link, attention_layout(vllm_config), num_blocks, groups)
        self._link = link

    # -- worker side -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer(layer_name)  # start_load_kv's loader writes layers in forward order

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save_layer(self._meta(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.finish_loads()  # layers no attention waited for are placed before the step ends
        if self.has_connector_metadata():
            self._worker.finish_saves(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Hybrid requests whose background load ended (a failed one is recomputed from its start)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        done, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def _meta(self) -> CrescentConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CrescentConnectorMetadata)
        return meta

    # -- scheduler side ----------------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        if self._scheduler is not None:
            self._scheduler.pool = gpu_block_pool

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves are queued by the end of each step: the blocks may be freed. A hybrid request's
        # resume keys travel back with its output (a vLLM prefill waits for them: handoff.py).
        params = self._scheduler.finished(request) if self._scheduler is not None else None
        return False, params

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._link is not None:
            self._link.close()
