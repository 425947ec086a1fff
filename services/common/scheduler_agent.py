"""An instance's side of the scheduler protocol: register, heartbeat, publish block events.

Runs as one background task per prefill/decode instance or kvstore node. The scheduler may
restart at any time: a heartbeat answered ``known=false`` (or a failed call) leads to
re-registration; whenever the scheduler asks for it (``want_full_snapshot`` in a register or
events reply) the agent sends a full snapshot of the blocks it holds, so the scheduler's index
never stays stale. A registration refused with FAILED_PRECONDITION (the instance disagrees
with its model's others) is final: ``failed`` is set, ``fatal_error`` says why, nothing retries.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from crescent.protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from crescent.services.common.grpc_service import GRPC_OPTIONS, open_channel
from crescent.services.common.tasks import cancel_and_wait
from crescent.services.common.tls import PeerTls

log = logging.getLogger(__name__)

RETRY_DELAY_S = 0.5
NUDGE_MIN_GAP_S = 0.02  # coalesce a burst of nudges into one heartbeat
SNAPSHOT_CHUNK = 50_000  # events per message of a full snapshot
# Reconnect to a restarted scheduler within a second, not after gRPC's default backoff (up to 120 s).
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
              ("grpc.max_reconnect_backoff_ms", 1000)]

BlockEvents = Callable[[], list[common_pb2.BlockEvent]]


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
        events: BlockEvents | None = None,
        snapshot: BlockEvents | None = None,
        tls: PeerTls | None = None,
    ) -> None:
        self._address = scheduler_address
        self._info = info
        self._load = load
        self._events = events
        self._snapshot = snapshot
        self._channel = open_channel(scheduler_address, tls, GRPC_OPTIONS + _RECONNECT)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._task: asyncio.Task[None] | None = None
        self._nudged = asyncio.Event()
        self._send_lock = asyncio.Lock()  # a snapshot and incremental events never cross
        self._snapshot_wanted = False
        self.registered = asyncio.Event()
        self.failed = asyncio.Event()
        self.fatal_error: str | None = None
        self.snapshots_sent = 0

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
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self.fatal_error = exc.details() or "registration refused"
                    log.error("the scheduler at %s refused this instance: %s", self._address, self.fatal_error)
                    self.failed.set()
                    return
                log.warning("scheduler at %s unreachable (%s); retrying", self._address, exc.code().name)
                await asyncio.sleep(RETRY_DELAY_S)

    async def _register(self) -> float:
        reply = await self._stub.Register(self._info, timeout=5)
        if reply.want_full_snapshot:
            self._snapshot_wanted = True
        await self._flush()
        self.registered.set()
        log.info("registered with scheduler at %s as %s", self._address, self.instance_id)
        return max(reply.heartbeat_interval_ms, 50) / 1000

    async def _beat(self) -> bool:
        await self._flush()
        reply = await self._stub.Heartbeat(self._load(), timeout=5)
        return reply.known

    def request_snapshot(self) -> None:
        """Send a full snapshot next instead of incremental events (e.g. events were dropped)."""
        self._snapshot_wanted = True

    async def _flush(self) -> None:
        """Send a full snapshot if one is wanted, else the events queued since the last send.
        On failure the events are lost, so a snapshot follows."""
        if self._events is None and self._snapshot is None:
            return
        async with self._send_lock:
            for _ in range(2):  # an events reply may ask for a snapshot: send it at once
                try:
                    if self._snapshot_wanted and self._snapshot is not None:
                        self._snapshot_wanted = False
                        if self._events is not None:
                            self._events()  # the snapshot below supersedes anything queued
                        await self._send(self._snapshot(), full=True)
                        self.snapshots_sent += 1
                        return
                    events = self._events() if self._events is not None else []
                    if not events or not await self._send(events, full=False):
                        return
                except grpc.aio.AioRpcError:
                    self._snapshot_wanted = True
                    raise

    async def _send(self, events: list[common_pb2.BlockEvent], full: bool) -> bool:
        """Publish ``events`` (a snapshot in chunks, the first one marked full); returns whether
        the scheduler asked for a full snapshot."""
        wanted = False
        for start in range(0, max(len(events), 1), SNAPSHOT_CHUNK):
            batch = common_pb2.BlockEventBatch(source_id=self.instance_id, events=events[start:start + SNAPSHOT_CHUNK],
                                               full_snapshot=full and start == 0)
            reply = await self._stub.PublishBlockEvents(batch, timeout=10)
            wanted = wanted or reply.want_full_snapshot
        if wanted and self._snapshot is not None:
            log.info("scheduler at %s asked for a full block snapshot", self._address)
            self._snapshot_wanted = True
        return wanted and self._snapshot is not None

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
        if not self.registered.is_set():
            return
        try:
            await self._flush()
        except grpc.aio.AioRpcError as exc:
            log.warning("could not publish block events (%s); a full snapshot follows", exc.code().name)
