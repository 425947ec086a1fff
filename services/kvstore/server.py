"""The kvstore process: builds the tiers from settings and serves them over gRPC.

``crescent serve kvstore --config FILE`` calls ``main``; tests run
``python -m crescent.services.kvstore.server --config FILE`` as a real process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import grpc

from crescent.protos import common_pb2
from crescent.services.common.grpc_service import GrpcService
from crescent.services.common.logs import configure_logging
from crescent.services.common.metrics import KvStoreMetrics, kvstore_metrics
from crescent.services.common.settings import SettingsError
from crescent.services.common.tasks import cancel_and_wait
from crescent.services.kvstore.config import KvStoreSettings, load_kvstore_settings
from crescent.services.kvstore.disk_tier import DiskTier
from crescent.services.kvstore.events import SchedulerLink
from crescent.services.kvstore.memory import keep_large_buffers_warm
from crescent.services.kvstore.s3_tier import S3Tier
from crescent.services.kvstore.servicer import KvStoreServicer, add_to_server
from crescent.services.kvstore.store import TieredStore
from crescent.services.kvstore.tier import HostTier, StorageTier

log = logging.getLogger(__name__)


def build_tiers(settings: KvStoreSettings, metrics: KvStoreMetrics) -> list[StorageTier]:
    tiers: list[StorageTier] = []
    t = settings.tiers
    if t.gpu.enabled:
        from crescent.services.kvstore.gpu_tier import GpuTier, cuda_available

        if cuda_available():
            tiers.append(GpuTier(t.gpu))
        else:
            log.warning("tiers.gpu.enabled is set but CUDA is not available; running without the GPU tier")
    if t.host.enabled:
        pinned = bool(tiers) and tiers[0].kind == common_pb2.KV_TIER_GPU  # page-locked only for a GPU
        if pinned and t.host.huge_pages != "off":
            raise SettingsError("tiers.host.huge_pages cannot be used with the GPU tier: its host pool is page-locked "
                                "by CUDA; set tiers.host.huge_pages=off or disable tiers.gpu")
        tiers.append(HostTier(t.host, pinned=pinned, shared=settings.shared_memory and not pinned))
    if t.disk.enabled:
        tiers.append(DiskTier(t.disk))
    if t.s3.enabled:
        tiers.append(S3Tier(t.s3, metrics))
    if not tiers:
        raise ValueError("no kvstore tier is enabled; enable at least tiers.host")
    return tiers


class KvStoreNode:
    """Everything one kvstore process runs, startable in-process (benchmarks) or by ``main``."""

    def __init__(self, settings: KvStoreSettings) -> None:
        self.settings = settings
        self.metrics = kvstore_metrics()
        self.tiers = build_tiers(settings, self.metrics)
        self.store: TieredStore | None = None
        self.servicer: KvStoreServicer | None = None
        self.scheduler_link: SchedulerLink | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.service = GrpcService("kvstore", settings.listen, self._setup, self._cleanup, details=self._details,
                                   on_started=self._link_scheduler, tls=settings.tls)

    def _details(self) -> dict[str, Any]:
        return {"node_id": self.settings.node_id, "tiers": [t.label for t in self.tiers]}

    async def _setup(self, server: grpc.aio.Server) -> None:
        for tier in self.tiers:
            await tier.start()
        self.store = TieredStore(
            self.tiers,
            self.metrics,
            eviction_policy=self.settings.eviction_policy,
            write_through=self.settings.write_policy == "write_through",
        )
        for index, tier in enumerate(self.tiers):
            if isinstance(tier, S3Tier):  # its index arrives when S3 answers
                self._tasks.append(asyncio.create_task(self._adopt_when_indexed(index, tier), name="s3-adopt"))
        self.servicer = KvStoreServicer(self.store, self.settings, self.service.tls)
        add_to_server(self.servicer, server)

    async def _link_scheduler(self, service: GrpcService) -> None:
        """Register with the scheduler once the port is known: a kvstore node is a shared prefix source."""
        settings = self.settings
        if not settings.scheduler_address:
            return
        assert self.store is not None
        address = settings.advertise_address or f"{settings.listen.host}:{service.port}"
        self.scheduler_link = SchedulerLink(settings.scheduler_address, settings.node_id, address, self.store,
                                            settings.events, self.service.tls)
        self.scheduler_link.start()

    async def _adopt_when_indexed(self, index: int, tier: S3Tier) -> None:
        await tier.indexed.wait()
        assert self.store is not None
        self.store.adopt(index, announce=True)

    async def _cleanup(self) -> None:
        await cancel_and_wait(*self._tasks)
        if self.scheduler_link is not None:
            await self.scheduler_link.close()
        if self.servicer is not None:
            await self.servicer.close()
        await self._spill()
        for tier in self.tiers:
            if isinstance(tier, S3Tier):
                await tier.flush(timeout_s=5.0)  # give queued uploads a chance before exit
        if self.store is not None:
            await self.store.close()

    async def _spill(self) -> None:
        """The host tier's own blocks onto the SSD tier, while the grace period lasts."""
        if self.store is None or self.settings.spill_on_stop_s <= 0:
            return
        start = time.monotonic()
        blocks, nbytes = await self.store.spill(start + self.settings.spill_on_stop_s)
        if blocks:
            log.info("spilled %d blocks (%.1f MB) from host memory to the SSD tier in %.1f s before stopping",
                     blocks, nbytes / 1e6, time.monotonic() - start)

    async def start(self) -> None:
        await self.service.start()

    async def stop(self) -> None:
        await self.service.stop()


async def serve(settings: KvStoreSettings) -> None:
    node = KvStoreNode(settings)
    await node.service.run_until_signalled()


def main(config_path: Path | None = None) -> None:
    """Run a kvstore node until SIGTERM/SIGINT, then stop cleanly."""
    configure_logging("kvstore")
    keep_large_buffers_warm()
    settings = load_kvstore_settings(config_path)
    asyncio.run(serve(settings))


def _cli() -> None:
    parser = argparse.ArgumentParser(description="Run one Crescent kvstore node.")
    parser.add_argument("--config", type=Path, default=None, help="YAML settings file")
    args = parser.parse_args()
    main(args.config)


if __name__ == "__main__":
    _cli()
