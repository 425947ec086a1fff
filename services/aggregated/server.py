"""``crescent serve aggregated``: one process that prefills and decodes (issue 15, item 2).

One engine, one KV cache, one engine thread: the Prefill and Decode gRPC services of a
prefill and a decode instance on one port, registered with the scheduler as one
``INSTANCE_ROLE_AGGREGATED`` instance. Prompts are computed in chunks mixed into decode steps
(``batcher.py``) and a request placed to decode here never copies its KV. On a small machine
this is one thread team on all the cores instead of two processes contending for them.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from crescent.services.aggregated.batcher import MixedBatcher
from crescent.services.aggregated.config import ENV_PREFIX, AggregatedSettings
from crescent.services.aggregated.servicer import AggregatedPrefillServicer
from crescent.services.common.logs import configure_logging
from crescent.services.common.settings import load_settings
from crescent.services.decode.server import DecodeRole
from crescent.services.decode.servicer import DecodeServicer, add_decode_to_server
from crescent.services.engine.constraints import Constraints
from crescent.services.instance.shell import EngineInstance, EngineLoad
from crescent.services.instance.runtime import ShutdownSignals, run_engine_process
from crescent.services.kvstore.memory import keep_large_buffers_warm
from crescent.services.prefill.server import PrefillRole, block_publisher, kvstore_client
from crescent.services.prefill.servicer import add_prefill_to_server


class AggregatedRole:
    """Both roles' load reports and drains, over one batcher and one prefill servicer."""

    def __init__(self, prefill: PrefillRole, decode: DecodeRole) -> None:
        self.prefill = prefill
        self.decode = decode

    def load(self) -> EngineLoad:
        decode, prefill = self.decode.load(), self.prefill.load()
        return EngineLoad(
            queued_requests=decode.queued_requests, queued_tokens=decode.queued_tokens,
            running_requests=decode.running_requests, free_kv_tokens=decode.free_kv_tokens,
            active_request_ids=sorted({*decode.active_request_ids, *prefill.active_request_ids}),
            finished_request_ids=[*decode.finished_request_ids, *prefill.finished_request_ids],
            prefill_queued_requests=prefill.queued_requests, prefill_queued_tokens=prefill.queued_tokens,
            prefill_running_requests=prefill.running_requests,
        )

    def stop_accepting(self) -> None:
        self.prefill.stop_accepting()
        self.decode.stop_accepting()

    def busy(self) -> bool:
        return self.prefill.busy() or self.decode.busy()

    async def end_remaining(self) -> None:
        await self.decode.end_remaining()

    async def close(self) -> None:
        await self.prefill.close()
        await self.decode.close()


async def serve(settings: AggregatedSettings, instance: EngineInstance, signals: ShutdownSignals) -> None:
    async def attach(server: grpc.aio.Server) -> AggregatedRole:
        engine = instance.engine
        assert engine is not None
        batcher = MixedBatcher(engine, instance.worker, settings.engine.max_batch_size, settings.unclaimed_timeout_s,
                               settings.chunk_tokens)
        batcher.on_change = instance.nudge
        batcher.start()
        constraints = Constraints.for_model(settings.engine.model, engine.config.vocab_size, engine.config.eos_token_ids)
        decode = DecodeServicer(batcher, constraints)
        kvstore = kvstore_client(settings, instance)
        prefill = AggregatedPrefillServicer(
            engine, instance.worker, kvstore, settings.kvstore_lease_ms, block_publisher(instance),
            scheduler_address=settings.scheduler_address, constraints=constraints, tls=instance.tls,
            batcher=batcher, decode=decode, own_address=lambda: instance.address,
        )
        prefill.load.on_change = instance.nudge
        add_prefill_to_server(prefill, server)
        add_decode_to_server(decode, server)
        return AggregatedRole(PrefillRole(prefill, kvstore), DecodeRole(batcher))

    await instance.run(attach, signals)


def main(config_path: Path | None = None) -> None:
    configure_logging("aggregated")
    keep_large_buffers_warm()
    settings = load_settings(AggregatedSettings, config_path, env_prefix=ENV_PREFIX)
    if settings.engine.backend == "vllm":  # vLLM's engine in this process (services/engine_vllm)
        from crescent.services.engine_vllm.server import main as serve_on_vllm

        serve_on_vllm(settings)
        return
    instance = EngineInstance("aggregated", settings.listen, settings.engine, settings.scheduler_address,
                              settings.instance_id, settings.advertise_address, settings.tls)
    run_engine_process(instance.worker, lambda signals: serve(settings, instance, signals))
