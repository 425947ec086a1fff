"""The instance side of the protocol against a real scheduler process: snapshots after a
scheduler restart, and a registration the scheduler refuses for good."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from crescent.protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from crescent.services.contract.block_keys import prefix_block_keys
from crescent.services.common.scheduler_agent import SchedulerAgent

from .support import instance

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

KEYS = prefix_block_keys(list(range(4 * 6)), 4, "m")


def blocks(keys) -> list[common_pb2.BlockEvent]:
    return [common_pb2.BlockEvent(kind=common_pb2.BLOCK_EVENT_STORED, key=k, tier=common_pb2.KV_TIER_ENGINE) for k in keys]


async def indexed_blocks(address: str, instance_id: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await scheduler_pb2_grpc.SchedulerStub(channel).ListInstances(scheduler_pb2.ListInstancesRequest())
    return next((s.indexed_blocks for s in reply.instances if s.info.instance_id == instance_id), -1)


async def until(predicate, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.05)


async def test_a_restarted_scheduler_gets_the_full_block_snapshot_back(start_scheduler) -> None:
    sched = start_scheduler(heartbeat_interval_s=0.2, heartbeat_timeout_s=2)
    held = list(KEYS[:4])
    queued: list[common_pb2.BlockEvent] = []
    agent = SchedulerAgent(sched.address, instance("p0", "prefill"),
                           lambda: scheduler_pb2.InstanceLoad(instance_id="p0"),
                           events=lambda: [queued.pop() for _ in range(len(queued))], snapshot=lambda: blocks(held))
    agent.start()
    try:
        await until(lambda: _eq(sched.address, 4), 10)
        held.extend(KEYS[4:6])
        queued.extend(blocks(KEYS[4:6]))
        await agent.publish_now()
        assert await indexed_blocks(sched.address, "p0") == 6
        await asyncio.to_thread(sched.stop)
        await asyncio.to_thread(sched.start)  # same port, empty index
        started = asyncio.get_running_loop().time()
        await until(lambda: _eq(sched.address, 6), 10)
        recovered_s = asyncio.get_running_loop().time() - started
        assert recovered_s < 5, recovered_s
        assert agent.snapshots_sent >= 2 and agent.fatal_error is None
    finally:
        await agent.stop()


async def _eq(address: str, n: int) -> bool:
    try:
        return await indexed_blocks(address, "p0") == n
    except grpc.aio.AioRpcError:
        return False


async def test_a_refused_registration_is_final_and_says_why(start_scheduler) -> None:
    sched = start_scheduler()
    sched.stub.Register(instance("p0", "prefill", block_size=64))
    info = instance("p1", "prefill", block_size=32)
    agent = SchedulerAgent(sched.address, info, lambda: scheduler_pb2.InstanceLoad(instance_id="p1"))
    agent.start()
    try:
        await asyncio.wait_for(agent.failed.wait(), 10)
        assert "block_size 32 differs from 64" in agent.fatal_error
        assert not agent.registered.is_set()
        listed = sched.stub.ListInstances(scheduler_pb2.ListInstancesRequest()).instances
        assert [s.info.instance_id for s in listed] == ["p0"]
    finally:
        await agent.stop()
