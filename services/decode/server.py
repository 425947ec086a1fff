"""``crescent serve decode``: one decode instance."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from crescent.protos import decode_pb2_grpc
from crescent.services.common.logs import configure_logging
from crescent.services.common.settings import load_settings
from crescent.services.decode.batcher import Batcher
from crescent.services.decode.config import ENV_PREFIX, DecodeSettings
from crescent.services.decode.servicer import DecodeServicer
from crescent.services.engine.instance import EngineInstance
from crescent.services.engine.runtime import run_engine_process


async def serve(settings: DecodeSettings, instance: EngineInstance, stop: asyncio.Event) -> None:
    async def attach(server: grpc.aio.Server):
        assert instance.engine is not None
        batcher = Batcher(instance.engine, instance.worker, settings.engine.max_batch_size, settings.unclaimed_timeout_s)
        batcher.start()

        def load() -> tuple[int, int, int]:
            active = [r for r in batcher.requests.values() if not r.finished]
            context = sum(r.seq.num_tokens for r in active)
            running = min(len(active), batcher.max_batch_size)
            return len(active) - running, context, running

        instance.load = load
        batcher.on_kv_freed = lambda: instance.agent.nudge() if instance.agent is not None else None
        decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(batcher), server)
        return batcher.stop

    await instance.run(attach, stop)


def main(config_path: Path | None = None) -> None:
    configure_logging("decode")
    settings = load_settings(DecodeSettings, config_path, env_prefix=ENV_PREFIX)
    instance = EngineInstance("decode", settings.listen, settings.engine, settings.scheduler_address,
                              settings.instance_id, settings.advertise_address)
    run_engine_process(instance.worker, lambda stop: serve(settings, instance, stop))
