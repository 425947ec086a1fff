"""``crescent serve decode``: one decode instance."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc

from crescent.services.common.logs import configure_logging
from crescent.services.common.settings import load_settings
from crescent.services.decode.batcher import DRAINING, Batcher
from crescent.services.decode.config import ENV_PREFIX, DecodeSettings
from crescent.services.decode.handoff_side import HandoffSideChannel
from crescent.services.decode.servicer import DecodeServicer, add_decode_to_server
from crescent.services.common.tls import PeerTls
from crescent.services.engine.cache_api import LayeredKvCache
from crescent.services.engine.constraints import Constraints
from crescent.services.engine.engine import Engine
from crescent.services.instance.shell import EngineInstance, EngineLoad
from crescent.services.instance.runtime import ShutdownSignals, run_engine_process
from crescent.services.kvwire.layer_wire import buffers_nbytes
from crescent.services.kvwire.side_channel import SideTls

log = logging.getLogger(__name__)

END_STREAMS_WAIT_S = 1.0  # after ending the streams: time for their readers to get the status


class DecodeRole:
    """The decode part of an engine instance: load reports and drain, over the batcher."""

    def __init__(self, batcher: Batcher, side: HandoffSideChannel | None = None) -> None:
        self.batcher = batcher
        self.side = side

    def load(self) -> EngineLoad:
        b = self.batcher
        admitted = [c for _, c in b.open_sequences()]
        in_step = min(len(admitted), b.max_batch_size)
        return EngineLoad(
            queued_requests=len(b.waiting) + len(admitted) - in_step,
            queued_tokens=sum(c.seq.num_tokens if c.seq else len(c.token_ids) for c in admitted)
            + sum(len(c.token_ids) for r in b.waiting for c in r.choices),
            running_requests=in_step,
            active_request_ids=list(b.requests),
            finished_request_ids=b.drain_left(),
            free_kv_tokens=b.free_kv_tokens,
        )

    def stop_accepting(self) -> None:
        self.batcher.draining = True

    def busy(self) -> bool:
        return bool(self.batcher.requests)

    async def end_remaining(self) -> None:
        self.batcher.end_all(DRAINING, "decode draining")
        deadline = asyncio.get_running_loop().time() + END_STREAMS_WAIT_S
        while any(r.claimed for r in self.batcher.requests.values()) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        if self.side is not None:
            self.side.close()
        await self.batcher.stop()


def handoff_side_channel(settings: DecodeSettings, engine: Engine, tls: PeerTls | None) -> HandoffSideChannel | None:
    """The handoff side channel on listen.host, mutual TLS when gRPC has it; None when the cache
    takes no layer-wise handoff. Advertised as the host of advertise_address, else listen.host
    (prefill replaces an unspecified one with the host it dials for gRPC)."""
    cache = engine.cache
    if not isinstance(cache, LayeredKvCache):
        return None
    layout = cache.layer_layout()
    max_bytes = buffers_nbytes(layout, [layout.layer_bytes(cache.capacity_tokens)])
    host = settings.listen.host
    advertise = settings.advertise_address.rpartition(":")[0] if settings.advertise_address else host
    side = HandoffSideChannel(host, settings.handoff_side_channel_port, advertise, max_bytes,
                              server_tls=SideTls(tls) if tls is not None else None)
    log.info("handoff side channel on %s:%d (%s)", host, side.server.port,
             "mutual TLS + one-time tokens" if tls is not None else "one-time tokens")
    return side


async def serve(settings: DecodeSettings, instance: EngineInstance, signals: ShutdownSignals) -> None:
    async def attach(server: grpc.aio.Server) -> DecodeRole:
        assert instance.engine is not None
        batcher = Batcher(instance.engine, instance.worker, settings.engine.max_batch_size, settings.unclaimed_timeout_s)
        batcher.on_change = instance.nudge
        batcher.start()
        engine = instance.engine
        constraints = Constraints.for_model(settings.engine.model, engine.config.vocab_size, engine.config.eos_token_ids)
        side = handoff_side_channel(settings, engine, instance.tls) if settings.tcp_handoff else None
        add_decode_to_server(DecodeServicer(batcher, constraints, shm_handoff=settings.shm_handoff, side=side), server)
        return DecodeRole(batcher, side)

    await instance.run(attach, signals)


def main(config_path: Path | None = None) -> None:
    configure_logging("decode")
    settings = load_settings(DecodeSettings, config_path, env_prefix=ENV_PREFIX)
    if settings.engine.backend == "vllm":  # vLLM's engine in this process (services/engine_vllm)
        from crescent.services.engine_vllm.server import main as serve_on_vllm
        serve_on_vllm(settings, "decode")
        return
    instance = EngineInstance("decode", settings.listen, settings.engine, settings.scheduler_address,
                              settings.instance_id, settings.advertise_address, settings.tls)
    run_engine_process(instance.worker, lambda signals: serve(settings, instance, signals))
