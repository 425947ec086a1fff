"""The scheduler service process: ``crescent serve scheduler --config FILE`` calls ``main``."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from crescent.protos import scheduler_pb2_grpc
from crescent.services.common.grpc_service import GrpcService
from crescent.services.common.logs import configure_logging
from crescent.services.common.tasks import cancel_and_wait
from crescent.services.scheduler.conductor import Conductor
from crescent.services.scheduler.config import SchedulerSettings, load_scheduler_settings
from crescent.services.scheduler.datatypes import InstanceId, Role
from crescent.services.scheduler.discovery import DiscoveredEndpoint, DiscoveredMembership, EndpointSliceWatcher
from crescent.services.scheduler.servicer import SchedulerServicer

if TYPE_CHECKING:
    from crescent.services.scheduler.picker_server import PickerServer

log = logging.getLogger(__name__)


class SchedulerService:
    """The Conductor behind a gRPC server, plus the task that drops silent instances."""

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.conductor = Conductor(settings)
        self.servicer = SchedulerServicer(self.conductor)
        self._reaper: asyncio.Task[None] | None = None
        self._discovery: asyncio.Task[None] | None = None
        self.membership: DiscoveredMembership | None = None
        if settings.discovery.enabled:
            self.membership = DiscoveredMembership(self.conductor, settings.discovery)
        self.grpc = GrpcService("scheduler", settings.listen, self._setup, self._cleanup, details=self._details,
                                tls=settings.tls)
        self.picker_server: PickerServer | None = None
        self.picker_port = 0

    async def _setup(self, server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.servicer, server)
        self._reaper = asyncio.create_task(self._reap(), name="scheduler-reaper")
        if self.membership is not None:
            watcher = EndpointSliceWatcher(self.settings.discovery, self._discovered)
            self._discovery = asyncio.create_task(watcher.run(), name="scheduler-discovery")
        if self.settings.endpoint_picker.enabled:
            await self._start_picker()

    async def _start_picker(self) -> None:
        """The Inference Extension's endpoint picker: its own port (the proxy dials it, not the
        engines), TLS without a client certificate unless endpoint_picker.tls says otherwise
        (picker_server.py), and grpc.health.v1 beside ext_proc."""
        from crescent.services.scheduler.picker_server import build_picker_server

        s = self.settings.endpoint_picker
        server = build_picker_server(self.conductor, s, self.grpc.tls, self.settings.listen.host)
        self.picker_port = await server.start()
        self.picker_server = server
        log.info("endpoint picker (ext_proc, grpc.health.v1) on :%d over %s, routing to the gateways at %s",
                 self.picker_port, server.transport.description, s.gateways)

    def _discovered(self, endpoints: dict[InstanceId, DiscoveredEndpoint]) -> None:
        assert self.membership is not None
        self.membership.update(endpoints)
        self.servicer.refresh_gauges()

    async def _cleanup(self) -> None:
        if self.picker_server is not None:
            await self.picker_server.stop()
            self.picker_server = None
        await cancel_and_wait(self._discovery, self._reaper)
        self._reaper = self._discovery = None

    async def _reap(self) -> None:
        period = min(self.settings.heartbeat_interval_s, self.settings.heartbeat_timeout_s / 3)
        while True:
            await asyncio.sleep(period)
            if self.membership is not None:
                self.membership.keep_alive()
            self.conductor.expire()
            self.servicer.refresh_gauges()

    def _details(self) -> dict[str, Any]:
        registry = self.conductor.registry
        return {
            "policy": self.settings.policy.name,
            "prefill_instances": len(registry.live(Role.PREFILL)),
            "decode_instances": len(registry.live(Role.DECODE)),
            "indexed_blocks": len(self.conductor.index),
            "endpoint_picker_port": self.picker_port or None,
        }


def main(config_path: Path | None = None) -> None:
    settings = load_scheduler_settings(config_path)
    configure_logging("scheduler", settings.log_level)
    log.info("policy %s, heartbeat timeout %.1fs", settings.policy.name, settings.heartbeat_timeout_s)
    asyncio.run(serve(settings))


async def serve(settings: SchedulerSettings) -> None:
    """Run until SIGINT/SIGTERM. The gRPC server must be built inside the running loop."""
    await SchedulerService(settings).grpc.run_until_signalled()
