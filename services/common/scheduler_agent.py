"""An instance's side of the scheduler protocol: register, heartbeat, publish block events.

Runs as one background task per prefill/decode instance. The scheduler may restart at any time:
a heartbeat answered ``known=false`` (or a failed call) leads to re-registration followed by a
full snapshot of the instance's cached blocks, so the scheduler's index never stays stale.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from crescent.protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from crescent.services.common.grpc_service import insecure_channel
from crescent.services.common.tasks import cancel_and_wait

log = logging.getLogger(__name__)

RETRY_DELAY_S = 0.5
NUDGE_MIN_GAP_S = 0.02  # coalesce a burst of nudges into one heartbeat


class SchedulerAgent:
    """Keeps one instance registered with the scheduler for the life of the process.

    ``load`` returns the current InstanceLoad; ``events`` drains block events since the last
    call; ``snapshot`` lists every block the instance holds (for a full resync).
    """

    def __init__(
        self,
        scheduler_address: str,
        info: scheduler_pb2.InstanceInfo,
        load: Callable[[], scheduler_pb2.InstanceLoad],
        events: Callable[[], list[common_pb2.BlockEvent]] | None = None,
        snapshot: Callable[[], list[common_pb2.BlockEvent]] | None = None,
    ) -> None:
        self._address = scheduler_address
        self._info = info
        self._load = load
        self._events = events
        self._snapshot = snapshot
        self._channel = insecure_channel(scheduler_address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._task: asyncio.Task[None] | None = None
        self._nudged = asyncio.Event()
        self.registered = asyncio.Event()

    @property
    def instance_id(self) -> str:
        return self._info.instance_id

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler-agent")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        await self._channel.close()

    async def _run(self) -> None:
        while True:
            try:
                interval = await self._register()
                while await self._beat():
                    try:  # the next beat comes after the interval, or sooner when nudged
                        await asyncio.wait_for(self._nudged.wait(), timeout=interval)
                        await asyncio.sleep(NUDGE_MIN_GAP_S)
                    except TimeoutError:
                        pass
                    self._nudged.clear()
                log.warning("scheduler at %s no longer knows this instance; registering again", self._address)
            except grpc.aio.AioRpcError as exc:
                self.registered.clear()
                log.warning("scheduler at %s unreachable (%s); retrying", self._address, exc.code().name)
                await asyncio.sleep(RETRY_DELAY_S)

    async def _register(self) -> float:
        reply = await self._stub.Register(self._info, timeout=5)
        if self._snapshot is not None:
            if self._events is not None:
                self._events()  # the snapshot below supersedes anything queued
            await self._stub.PublishBlockEvents(
                common_pb2.BlockEventBatch(source_id=self.instance_id, events=self._snapshot(), full_snapshot=True),
                timeout=10,
            )
        self.registered.set()
        log.info("registered with scheduler at %s as %s", self._address, self.instance_id)
        return max(reply.heartbeat_interval_ms, 50) / 1000

    async def _beat(self) -> bool:
        if self._events is not None:
            events = self._events()
            if events:
                await self._stub.PublishBlockEvents(
                    common_pb2.BlockEventBatch(source_id=self.instance_id, events=events), timeout=5
                )
        reply = await self._stub.Heartbeat(self._load(), timeout=5)
        return reply.known

    async def deregister(self, timeout_s: float = 2.0) -> None:
        """Leave placement now (draining) and stop heartbeating, so nothing re-registers us."""
        await cancel_and_wait(self._task)
        self._task = None
        self.registered.clear()
        try:
            await self._stub.Deregister(scheduler_pb2.DeregisterRequest(instance_id=self.instance_id), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not deregister from the scheduler at %s: %s", self._address, exc.code().name)

    def nudge(self) -> None:
        """Report load now rather than at the next interval (e.g. KV just freed): the
        scheduler admits against what instances last reported."""
        self._nudged.set()

    async def publish_now(self) -> None:
        """Send queued block events at once (after a prefill stored new blocks)."""
        if self._events is None or not self.registered.is_set():
            return
        events = self._events()
        if events:
            try:
                await self._stub.PublishBlockEvents(
                    common_pb2.BlockEventBatch(source_id=self.instance_id, events=events), timeout=5
                )
            except grpc.aio.AioRpcError as exc:
                log.warning("could not publish %d block events: %s", len(events), exc.code().name)
