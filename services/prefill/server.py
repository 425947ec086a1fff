"""``crescent serve prefill``: one prefill instance."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc

from crescent.services.common.logs import configure_logging
from crescent.services.common.settings import load_settings
from crescent.services.engine.constraints import Constraints
from crescent.services.engine.device_blocks import DeviceBlocks
from crescent.services.instance.shell import EngineInstance, EngineLoad
from crescent.services.instance.runtime import ShutdownSignals, run_engine_process
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvstore.cuda_ipc import CudaIpc
from crescent.services.kvstore.memory import keep_large_buffers_warm
from crescent.services.prefill.config import ENV_PREFIX, PrefillBaseSettings, PrefillSettings
from crescent.services.prefill.handoff_mover import HandoffMovers
from crescent.services.prefill.servicer import PrefillServicer, add_prefill_to_server


class PrefillRole:
    """The prefill part of an engine instance: load reports and drain, over the servicer."""

    def __init__(self, servicer: PrefillServicer, kvstore: KvStoreClient | None) -> None:
        self.servicer = servicer
        self.kvstore = kvstore

    def load(self) -> EngineLoad:
        load = self.servicer.load
        queued, queued_tokens, running = load.report()
        return EngineLoad(queued_requests=queued, queued_tokens=queued_tokens, running_requests=running,
                          active_request_ids=load.active_ids(), finished_request_ids=load.drain_left())

    def stop_accepting(self) -> None:
        self.servicer.draining = True

    def busy(self) -> bool:
        return self.servicer.busy()

    async def end_remaining(self) -> None:
        """Nothing to do: stopping the server ends the calls left, and the gateway places them again."""

    async def close(self) -> None:
        await self.servicer.close()
        if self.kvstore is not None:
            await self.kvstore.close()


def kvstore_client(settings: PrefillBaseSettings, instance: EngineInstance) -> KvStoreClient | None:
    """The node's kvstore, if the settings name one. A KV pool on a GPU shares its blocks with the
    node's GPU tier through CUDA IPC where the node is on the same GPU (``prefill/device_store.py``)."""
    if not settings.kvstore_address:
        return None
    on_gpu = instance.engine is not None and DeviceBlocks.for_cache(instance.engine.cache) is not None
    return KvStoreClient(settings.kvstore_address, shared_memory=settings.kvstore_shared_memory, tls=instance.tls,
                         device_opener=CudaIpc() if on_gpu else None)


def block_publisher(instance: EngineInstance):
    """What prefill calls when new blocks are cached: publish them to the scheduler now."""
    def publish_soon() -> None:
        if instance.agent is not None:
            asyncio.get_running_loop().create_task(instance.agent.publish_now())

    return publish_soon


async def serve(settings: PrefillSettings, instance: EngineInstance, signals: ShutdownSignals) -> None:
    async def attach(server: grpc.aio.Server) -> PrefillRole:
        assert instance.engine is not None
        kvstore = kvstore_client(settings, instance)
        engine = instance.engine
        servicer = PrefillServicer(engine, instance.worker, kvstore, settings.kvstore_lease_ms, block_publisher(instance),
                                   scheduler_address=settings.scheduler_address,
                                   constraints=Constraints.for_model(settings.engine.model, engine.config.vocab_size,
                                                                     engine.config.eos_token_ids),
                                   tls=instance.tls, max_batch_tokens=settings.max_batch_tokens,
                                   layerwise_handoff=settings.layerwise_handoff,
                                   layerwise_kvstore=settings.layerwise_kvstore,
                                   handoff_movers=HandoffMovers(
                                       settings.instance_id or f"prefill-{socket.gethostname()}-{settings.listen.port}",
                                       settings.shm_handoff, settings.tcp_handoff, instance.tls))
        servicer.load.on_change = instance.nudge
        add_prefill_to_server(servicer, server)
        return PrefillRole(servicer, kvstore)

    await instance.run(attach, signals)


def main(config_path: Path | None = None) -> None:
    configure_logging("prefill")
    keep_large_buffers_warm()  # KV blocks arrive as multi-MB buffers: reuse them, do not fault them in
    settings = load_settings(PrefillSettings, config_path, env_prefix=ENV_PREFIX)
    if settings.engine.backend == "vllm":  # vLLM's engine in this process (services/engine_vllm)
        from crescent.services.engine_vllm.server import main as serve_on_vllm
        serve_on_vllm(settings, "prefill")
        return
    instance = EngineInstance("prefill", settings.listen, settings.engine, settings.scheduler_address,
                              settings.instance_id, settings.advertise_address, settings.tls)
    run_engine_process(instance.worker, lambda signals: serve(settings, instance, signals))
