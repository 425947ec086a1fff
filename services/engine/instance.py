"""The process shell shared by prefill and decode instances.

Loads the engine, starts the gRPC service, registers with the scheduler and heartbeats its load.
The role-specific part (servicer, batcher) comes in through ``attach``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import grpc

from crescent.protos import common_pb2, scheduler_pb2
from crescent.services.common.grpc_service import GrpcService
from crescent.services.common.scheduler_agent import SchedulerAgent
from crescent.services.common.settings import ListenSettings
from crescent.services.engine.engine import Engine
from crescent.services.engine.kv_cache import PageEventKind
from crescent.services.engine.runtime import EngineWorker, build_engine
from crescent.services.engine.settings import EngineSettings

log = logging.getLogger(__name__)

ROLES = {"prefill": scheduler_pb2.INSTANCE_ROLE_PREFILL, "decode": scheduler_pb2.INSTANCE_ROLE_DECODE}


_EVENT_KINDS = {PageEventKind.STORED: common_pb2.BLOCK_EVENT_STORED, PageEventKind.REMOVED: common_pb2.BLOCK_EVENT_REMOVED}


def _event(engine: Engine, kind: int, key: bytes, parent: bytes | None) -> common_pb2.BlockEvent:
    return common_pb2.BlockEvent(kind=kind, key=key, parent_key=parent or b"", tier=common_pb2.KV_TIER_ENGINE,
                                 num_tokens=engine.page_size)


def block_events(engine: Engine) -> list[common_pb2.BlockEvent]:
    """Blocks stored in or evicted from the engine's cache since the last call."""
    return [_event(engine, _EVENT_KINDS[e.kind], e.key, e.parent_key) for e in engine.cache.pages.drain_events()]


def block_snapshot(engine: Engine) -> list[common_pb2.BlockEvent]:
    """Every block the engine's cache holds, for a full resync of the scheduler's index."""
    return [_event(engine, common_pb2.BLOCK_EVENT_STORED, key, parent) for key, parent in engine.cache.pages.snapshot()]


class EngineInstance:
    """One prefill or decode process: engine + worker + gRPC service + scheduler agent."""

    def __init__(self, role: str, listen: ListenSettings, engine_settings: EngineSettings, scheduler_address: str,
                 instance_id: str, advertise_address: str) -> None:
        self.role = role
        self.listen = listen
        self.engine_settings = engine_settings
        self.scheduler_address = scheduler_address
        self._instance_id = instance_id
        self._advertise = advertise_address
        self.engine: Engine | None = None
        self.worker = EngineWorker(role)
        self.agent: SchedulerAgent | None = None
        self.load: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0)  # queued requests, queued tokens, running

    async def run(self, attach: Callable[[grpc.aio.Server], Awaitable[Callable[[], Awaitable[None]]]],
                  stop: asyncio.Event) -> None:
        """Load the engine, serve until ``stop``. ``attach`` adds servicers and returns their cleanup."""
        self.engine = await self.worker.run(build_engine, self.engine_settings)
        cleanups: list[Callable[[], Awaitable[None]]] = []

        async def setup(server: grpc.aio.Server) -> None:
            cleanups.append(await attach(server))

        async def cleanup() -> None:
            if self.agent is not None:
                await self.agent.stop()
            for fn in cleanups:
                await fn()

        async def register(service: GrpcService) -> None:
            self.agent = SchedulerAgent(
                self.scheduler_address, self._info(service.port), self._load_message,
                events=(lambda: block_events(self.engine)) if self.role == "prefill" else None,
                snapshot=(lambda: block_snapshot(self.engine)) if self.role == "prefill" else None,
            )
            self.agent.start()

        service = GrpcService(
            self.role, self.listen, setup, cleanup,
            ready=lambda: self.agent is not None and self.agent.registered.is_set(),
            details=self._details, on_started=register,
        )
        await service.run_until(stop)

    def _info(self, port: int) -> scheduler_pb2.InstanceInfo:
        assert self.engine is not None
        address = self._advertise or f"{self.listen.host}:{port}"
        return scheduler_pb2.InstanceInfo(
            instance_id=self._instance_id or f"{self.role}-{socket.gethostname()}-{port}",
            role=ROLES[self.role], address=address, model_id=self.engine.model_id,
            block_size=self.engine.page_size, kv_capacity_tokens=self.engine.cache.capacity_tokens,
            max_batch_size=self.engine_settings.max_batch_size,
        )

    def _load_message(self) -> scheduler_pb2.InstanceLoad:
        assert self.engine is not None and self.agent is not None
        queued, queued_tokens, running = self.load()
        return scheduler_pb2.InstanceLoad(
            instance_id=self.agent.instance_id, queued_requests=queued, queued_tokens=queued_tokens,
            running_requests=running, free_kv_tokens=self.engine.cache.pages.free_pages * self.engine.page_size,
        )

    def _details(self) -> dict[str, object]:
        engine = self.engine
        if engine is None:
            return {"role": self.role}
        return {"role": self.role, "model": engine.model_id, "cached_blocks": engine.cache.pages.cached_blocks}
