"""The scheduler service process: ``crescent serve scheduler --config FILE`` calls ``main``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import grpc

from crescent.protos import scheduler_pb2_grpc
from crescent.services.common.grpc_service import GrpcService
from crescent.services.common.logs import configure_logging
from crescent.services.scheduler.conductor import Conductor
from crescent.services.scheduler.config import SchedulerSettings, load_scheduler_settings
from crescent.services.scheduler.datatypes import Role
from crescent.services.scheduler.servicer import SchedulerServicer

log = logging.getLogger(__name__)


class SchedulerService:
    """The Conductor behind a gRPC server, plus the task that drops silent instances."""

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.conductor = Conductor(settings)
        self.servicer = SchedulerServicer(self.conductor)
        self._reaper: asyncio.Task[None] | None = None
        self.grpc = GrpcService("scheduler", settings.listen, self._setup, self._cleanup, details=self._details)

    async def _setup(self, server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.servicer, server)
        self._reaper = asyncio.create_task(self._reap(), name="scheduler-reaper")

    async def _cleanup(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None

    async def _reap(self) -> None:
        period = min(self.settings.heartbeat_interval_s, self.settings.heartbeat_timeout_s / 3)
        while True:
            await asyncio.sleep(period)
            self.conductor.expire()
            self.servicer.refresh_gauges()

    def _details(self) -> dict[str, Any]:
        registry = self.conductor.registry
        return {
            "policy": self.settings.policy.name,
            "prefill_instances": len(registry.live(Role.PREFILL)),
            "decode_instances": len(registry.live(Role.DECODE)),
            "indexed_blocks": len(self.conductor.index),
        }


def main(config_path: Path | None = None) -> None:
    settings = load_scheduler_settings(config_path)
    configure_logging("scheduler", settings.log_level)
    log.info("policy %s, heartbeat timeout %.1fs", settings.policy.name, settings.heartbeat_timeout_s)
    asyncio.run(serve(settings))


async def serve(settings: SchedulerSettings) -> None:
    """Run until SIGINT/SIGTERM. The gRPC server must be built inside the running loop."""
    await SchedulerService(settings).grpc.run_until_signalled()
