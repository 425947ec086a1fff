"""Best-effort publishing of block events to the scheduler.

Events are batched for ``flush_interval_s``. The first batch after start and after any failed
call is a full snapshot of what the node holds, so a scheduler that restarted or missed events
converges; events that pile up while the scheduler is away are dropped (the snapshot replaces
them). Publishing never blocks or fails a store operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from crescent.protos import common_pb2, scheduler_pb2_grpc
from crescent.services.common.grpc_service import insecure_channel
from crescent.services.common.tasks import cancel_and_wait
from crescent.services.kvstore.config import EventSettings

log = logging.getLogger(__name__)


class EventPublisher:
    def __init__(
        self,
        address: str,
        node_id: str,
        snapshot: Callable[[], list[common_pb2.BlockEvent]],
        settings: EventSettings,
    ) -> None:
        self.address = address
        self.node_id = node_id
        self._snapshot = snapshot
        self._settings = settings
        self._pending: list[common_pb2.BlockEvent] = []
        self._need_snapshot = True
        self._wake = asyncio.Event()
        self._channel = insecure_channel(address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._task: asyncio.Task[None] | None = None
        self.batches_sent = 0
        self._connected = True
        self.snapshots_sent = 0

    def publish(self, event: common_pb2.BlockEvent) -> None:
        """Queue one event (a ``TieredStore`` sink)."""
        if self._need_snapshot:
            return  # the next snapshot includes it
        if len(self._pending) >= self._settings.max_pending:
            log.warning("scheduler %s is not keeping up; dropping events until a snapshot", self.address)
            self._pending.clear()
            self._need_snapshot = True
        self._pending.append(event)
        if len(self._pending) >= self._settings.max_batch:
            self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvstore-events")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        await self._channel.close()

    def _next_batch(self) -> common_pb2.BlockEventBatch | None:
        if self._need_snapshot:
            # Events after this point queue behind the snapshot; a failed send sets it again.
            self._need_snapshot = False
            self._pending.clear()
            return common_pb2.BlockEventBatch(source_id=self.node_id, events=self._snapshot(), full_snapshot=True)
        if not self._pending:
            return None
        events = self._pending[: self._settings.max_batch]
        del self._pending[: self._settings.max_batch]
        return common_pb2.BlockEventBatch(source_id=self.node_id, events=events)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._settings.flush_interval_s)
            self._wake.clear()
            while (batch := self._next_batch()) is not None:
                try:
                    await self._stub.PublishBlockEvents(batch, timeout=max(1.0, self._settings.retry_interval_s))
                except grpc.aio.AioRpcError as exc:
                    if self._connected:  # once per outage, not once per retry
                        self._connected = False
                        log.warning("cannot publish block events to %s (%s); will resend a snapshot",
                                    self.address, exc.code().name)
                    self._need_snapshot = True
                    self._pending.clear()
                    await asyncio.sleep(self._settings.retry_interval_s)
                    break
                self.batches_sent += 1
                if not self._connected:
                    self._connected = True
                    log.info("publishing block events to %s again", self.address)
                self.snapshots_sent += batch.full_snapshot
