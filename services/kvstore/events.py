"""The kvstore node's link to the scheduler: it registers and heartbeats like an engine (role
KVSTORE: a shared prefix source, never placed on) and publishes its block events.

The ``SchedulerAgent`` does the protocol — registration, heartbeats, a full snapshot whenever the
scheduler asks (after it restarted), retries. This module batches the store's events for
``flush_interval_s`` and hands them over; when events pile up while the scheduler is away they
are dropped and a snapshot replaces them. Publishing never blocks or fails a store operation.
"""

from __future__ import annotations

import asyncio
import logging

from crescent.protos import common_pb2, scheduler_pb2
from crescent.services.common.scheduler_agent import SchedulerAgent
from crescent.services.common.tasks import cancel_and_wait
from crescent.services.common.tls import PeerTls
from crescent.services.kvstore.config import EventSettings
from crescent.services.kvstore.store import TieredStore

log = logging.getLogger(__name__)


class SchedulerLink:
    def __init__(self, scheduler_address: str, node_id: str, address: str, store: TieredStore,
                 settings: EventSettings, tls: PeerTls | None = None) -> None:
        self._settings = settings
        self._pending: list[common_pb2.BlockEvent] = []
        self._wake = asyncio.Event()
        info = scheduler_pb2.InstanceInfo(instance_id=node_id, role=scheduler_pb2.INSTANCE_ROLE_KVSTORE, address=address)
        self.agent = SchedulerAgent(scheduler_address, info, lambda: scheduler_pb2.InstanceLoad(instance_id=node_id),
                                    events=self._drain, snapshot=store.snapshot_events, tls=tls)
        store.subscribe(self.publish)
        self._task: asyncio.Task[None] | None = None

    def publish(self, event: common_pb2.BlockEvent) -> None:
        """Queue one event (a ``TieredStore`` sink)."""
        if len(self._pending) >= self._settings.max_pending:
            log.warning("the scheduler is not keeping up; dropping block events until a snapshot")
            self._pending.clear()
            self.agent.request_snapshot()
        self._pending.append(event)
        self._wake.set()

    def _drain(self) -> list[common_pb2.BlockEvent]:
        events, self._pending = self._pending, []
        return events

    def start(self) -> None:
        self.agent.start()
        self._task = asyncio.create_task(self._flush_loop(), name="kvstore-events")

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            if len(self._pending) < self._settings.max_batch:
                await asyncio.sleep(self._settings.flush_interval_s)  # let a burst of puts share a message
            self._wake.clear()
            await self.agent.publish_now()  # before registration the snapshot at registering covers them

    async def close(self) -> None:
        """Leave the scheduler's index at once (prefills stop being sent here), then stop."""
        await cancel_and_wait(self._task)
        self._task = None
        await self.agent.deregister(timeout_s=1.0)
        await self.agent.stop()
