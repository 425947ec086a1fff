"""Many nodes: cross-node gets, replicate(key, node), and block events to the scheduler."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from crescent.protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from crescent.services.kvstore.client import KvStoreClient

from .conftest import free_port
from .helpers import MODEL, make_chain

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)


async def test_a_miss_is_fetched_from_a_peer_and_replicate_pushes_blocks(kvstore_node) -> None:
    a = kvstore_node(name="node-a")
    b = kvstore_node({"peers": {"node-a": a.address}}, name="node-b")
    c = kvstore_node(name="node-c")
    ca, cb, cc = KvStoreClient(a.address), KvStoreClient(b.address), KvStoreClient(c.address)
    try:
        chain = make_chain(4)
        await ca.put(chain[:3])
        prefix = await cb.get_prefix([x.key for x in chain], MODEL)
        assert [bytes(x.payload) for x in prefix] == [bytes(x.payload) for x in chain[:3]]
        # node-b kept the copies: they survive node-a going away
        assert a.stop() == 0
        assert await cb.exists([x.key for x in chain]) == [True, True, True, False]
        assert await cb.replicate([chain[0].key, chain[3].key], c.address) == 1
        got = await cc.get([chain[0].key], MODEL, local_only=True)
        assert bytes(got[chain[0].key].payload) == bytes(chain[0].payload)
    finally:
        for client in (ca, cb, cc):
            await client.close()


class RecordingScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Stands in for the scheduler: records registrations, heartbeats and published events.
    Like the real one after a restart, it wants a full snapshot from a source until it got one."""

    def __init__(self) -> None:
        self.registrations: list[scheduler_pb2.InstanceInfo] = []
        self.heartbeats = 0
        self.batches: list[common_pb2.BlockEventBatch] = []
        self.deregistered: list[str] = []
        self._snapshotted: set[str] = set()

    async def Register(self, request, context):
        self.registrations.append(request)
        self._snapshotted.discard(request.instance_id)
        return scheduler_pb2.RegisterReply(heartbeat_interval_ms=100, want_full_snapshot=True)

    async def Heartbeat(self, request, context):
        self.heartbeats += 1
        return scheduler_pb2.HeartbeatReply(known=True)

    async def PublishBlockEvents(self, request, context):
        self.batches.append(request)
        if request.full_snapshot:
            self._snapshotted.add(request.source_id)
        return scheduler_pb2.EventsReply(accepted=len(request.events),
                                         want_full_snapshot=request.source_id not in self._snapshotted)

    async def Deregister(self, request, context):
        self.deregistered.append(request.instance_id)
        return scheduler_pb2.DeregisterReply(removed=True)


async def start_scheduler(port: int) -> tuple[grpc.aio.Server, RecordingScheduler]:
    server, recorder = grpc.aio.server(), RecordingScheduler()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(recorder, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, recorder


async def until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def test_node_registers_as_a_kvstore_and_resends_a_snapshot_after_the_scheduler_restarts(kvstore_node) -> None:
    port = free_port()
    server, recorder = await start_scheduler(port)
    node = kvstore_node({"scheduler_address": f"127.0.0.1:{port}", "node_id": "kv-7"})
    client = KvStoreClient(node.address)
    try:
        await until(lambda: any(b.full_snapshot for b in recorder.batches))
        info = recorder.registrations[0]
        assert (info.instance_id, info.role, info.address) == ("kv-7", scheduler_pb2.INSTANCE_ROLE_KVSTORE, node.address)
        await until(lambda: recorder.heartbeats >= 2)  # it heartbeats like an engine
        chain = make_chain(2)
        await client.put(chain)
        await client.remove([chain[1].key])
        events = lambda: [(e.kind, e.key) for b in recorder.batches for e in b.events if not b.full_snapshot]
        await until(lambda: len(events()) == 3)
        assert events() == [
            (common_pb2.BLOCK_EVENT_STORED, chain[0].key),
            (common_pb2.BLOCK_EVENT_STORED, chain[1].key),
            (common_pb2.BLOCK_EVENT_REMOVED, chain[1].key),
        ]
        stored = [e for b in recorder.batches for e in b.events if e.kind == common_pb2.BLOCK_EVENT_STORED]
        assert stored[1].parent_key == chain[0].key and stored[0].tier == common_pb2.KV_TIER_HOST
        assert all(b.source_id == "kv-7" for b in recorder.batches)

        await server.stop(0)  # the scheduler restarts and has forgotten everything
        await client.put(make_chain(1, salt=b"while-away"))
        await asyncio.sleep(0.5)
        server, recorder = await start_scheduler(port)
        await until(lambda: any(b.full_snapshot for b in recorder.batches), timeout_s=5)
        snapshot = next(b for b in recorder.batches if b.full_snapshot)
        assert len(snapshot.events) == 2 and chain[0].key in {e.key for e in snapshot.events}
        assert [r.instance_id for r in recorder.registrations] == ["kv-7"]
        # A node stopping leaves the index at once rather than after a heartbeat timeout.
        assert await asyncio.to_thread(node.stop) == 0  # this loop must stay free to answer it
        assert recorder.deregistered == ["kv-7"]
    finally:
        await client.close()
        await server.stop(0)
