"""``crescent serve prefill``: one prefill instance."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from crescent.protos import prefill_pb2_grpc
from crescent.services.common.logs import configure_logging
from crescent.services.common.settings import load_settings
from crescent.services.engine.instance import EngineInstance
from crescent.services.engine.runtime import run_engine_process
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.kvstore.memory import keep_large_buffers_warm
from crescent.services.prefill.config import ENV_PREFIX, PrefillSettings
from crescent.services.prefill.servicer import PrefillServicer


async def serve(settings: PrefillSettings, instance: EngineInstance, stop: asyncio.Event) -> None:
    async def attach(server: grpc.aio.Server):
        assert instance.engine is not None
        kvstore = (
            KvStoreClient(settings.kvstore_address, shared_memory=settings.kvstore_shared_memory)
            if settings.kvstore_address else None
        )

        def publish_soon() -> None:
            if instance.agent is not None:
                asyncio.get_running_loop().create_task(instance.agent.publish_now())

        servicer = PrefillServicer(instance.engine, instance.worker, kvstore, settings.kvstore_lease_ms, publish_soon,
                                   scheduler_address=settings.scheduler_address)
        instance.load = servicer.load.report
        prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)

        async def cleanup() -> None:
            await servicer.close()
            if kvstore is not None:
                await kvstore.close()

        return cleanup

    await instance.run(attach, stop)


def main(config_path: Path | None = None) -> None:
    configure_logging("prefill")
    keep_large_buffers_warm()  # KV blocks arrive as multi-MB buffers: reuse them, do not fault them in
    settings = load_settings(PrefillSettings, config_path, env_prefix=ENV_PREFIX)
    instance = EngineInstance("prefill", settings.listen, settings.engine, settings.scheduler_address,
                              settings.instance_id, settings.advertise_address)
    run_engine_process(instance.worker, lambda stop: serve(settings, instance, stop))
