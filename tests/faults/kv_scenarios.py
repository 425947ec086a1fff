"""Faults about what decode holds: the gateway killed, clients gone, and an overload of a small
KV cache. KV is read from each decode instance's ``crescent_engine_kv_used_tokens`` gauge."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import grpc

from tests.faults.load import LoadClient, Prompt, StreamingLoad, StreamResult, document_prompts, story_prompts
from tests.faults.scenarios import (
    MAX_TOKENS,
    MIN_CHUNKS,
    STREAMS,
    FaultOutcome,
    finish_recovery,
    wait_recovered,
)
from tests.faults.stack import FaultStack

log = logging.getLogger(__name__)

KV_WATCH_S = 3.0  # how long to keep watching after the KV is back: a late handoff shows up here


def kv_freed_after(stack: FaultStack, since: float, baseline: float, watch_s: float = KV_WATCH_S,
                   poll_s: float = 0.02) -> float | None:
    """Seconds from ``since`` until the first poll that found decode KV in use back to
    ``baseline`` for good (an upper bound: the poll's answer arrived then), watching until
    ``watch_s`` after it last was above it. None: still held when the watch ended (30 s)."""
    freed_at: float | None = None
    give_up = since + 30
    while True:
        used = sum(v for v in stack.decode_kv_used().values() if v is not None)
        now = time.monotonic()
        if used > baseline:
            freed_at = None
        elif freed_at is None:
            freed_at = now
        elif now - freed_at >= watch_s:
            return freed_at - since
        if now > give_up:
            return None
        time.sleep(poll_s)


def scheduler_sees_freed_after(stack: FaultStack, since: float, timeout_s: float = 10) -> float | None:
    """Seconds from ``since`` until the scheduler's ListInstances reports every decode
    instance's whole KV free again (what placement decisions read); None if not within ``timeout_s``."""
    capacity = stack.plan.kv_capacity_tokens
    while time.monotonic() < since + timeout_s:
        try:
            free = stack.scheduler_free_kv()
        except grpc.RpcError:
            free = {}
        if len(free) == stack.plan.decode and all(v >= capacity for v in free.values()):
            return time.monotonic() - since
        time.sleep(0.05)
    return None


def idle_kv(stack: FaultStack) -> float:
    """Decode KV in use now, over every decode instance (0 with no request running)."""
    return sum(v for v in stack.decode_kv_used().values() if v is not None)


async def gateway_killed(stack: FaultStack, client: LoadClient) -> FaultOutcome:
    """SIGKILL the gateway mid-stream: its connections break; decode must free their KV."""
    baseline = idle_kv(stack)
    load = StreamingLoad(client, MAX_TOKENS, salt=f"fault-{uuid.uuid4().hex}")
    load.add_all(story_prompts(STREAMS))
    await load.wait_streaming(MIN_CHUNKS)
    held = idle_kv(stack)
    old_pid = stack.signal("gateway", signal.SIGKILL)
    signalled_at = time.monotonic()
    scheduler_freed = asyncio.create_task(asyncio.to_thread(scheduler_sees_freed_after, stack, signalled_at))
    kv_freed = await asyncio.to_thread(kv_freed_after, stack, signalled_at, baseline)
    recovery = asyncio.create_task(wait_recovered(stack, "gateway", old_pid, signalled_at))
    outcome = FaultOutcome("gateway SIGKILL", "gateway", signalled_at, await load.results(60), {},
                           kv_freed_s=kv_freed, kv_at_fault=held, scheduler_freed_s=await scheduler_freed)
    await finish_recovery(outcome, recovery)
    log.info(outcome.summary())
    return outcome


async def clients_gone(stack: FaultStack, client: LoadClient, *, before_first_token: bool) -> FaultOutcome:
    """Every client hangs up: mid-stream, or right after sending (while prefill still works, so
    the handoff to decode lands after the gateway knows the client left)."""
    baseline = idle_kv(stack)
    prompts = document_prompts(STREAMS, 150, tag="gone") if before_first_token else story_prompts(STREAMS)
    load = StreamingLoad(client, MAX_TOKENS, salt=f"fault-{uuid.uuid4().hex}")
    load.add_all(prompts)
    if before_first_token:
        await asyncio.sleep(0.3)
    else:
        await load.wait_streaming(MIN_CHUNKS)
    held = idle_kv(stack)
    gone_at = await load.hang_up()
    scheduler_freed = asyncio.create_task(asyncio.to_thread(scheduler_sees_freed_after, stack, gone_at))
    kv_freed = await asyncio.to_thread(kv_freed_after, stack, gone_at, baseline)
    where = "before the first token" if before_first_token else "mid-stream"
    outcome = FaultOutcome(f"client disconnect {where}", "client", gone_at, load.records, {}, kv_freed_s=kv_freed,
                           kv_at_fault=held, scheduler_freed_s=await scheduler_freed)
    log.info(outcome.summary())
    return outcome


# -- overload of a small KV cache -------------------------------------------------------------

OVERLOAD_REQUESTS = 24
OVERLOAD_WORDS = 200        # about 300 prompt tokens
OVERLOAD_MAX_TOKENS = 128   # prompt + max_tokens ~ 7 pages of 64: 4 fit a 2048-token decode at once
SEQUENTIAL_REQUESTS = 300
# A 429 is true when it says which SLO the request was predicted to miss, and by how much.
_PREDICTION = re.compile(r"\((ttft_slo|tbt_slo|decode_kv_full|decode_batch_full)\).*?exceeds the SLO of")


@dataclass
class OverloadOutcome:
    concurrent: list[StreamResult]
    sequential: list[StreamResult] = field(default_factory=list)
    seconds: float = 0.0

    def statuses(self, results: list[StreamResult]) -> Counter:
        return Counter(r.status for r in results)

    def aborted_after_accept(self) -> list[str]:
        return [r.describe() for r in self.concurrent + self.sequential if r.aborted_after_accept]

    def untrue_429s(self, results: list[StreamResult]) -> list[str]:
        return [f"{r.error_code}: {r.error_message}" for r in results
                if r.status == 429 and not _PREDICTION.search(r.error_message or "")]


async def overload(stack: FaultStack, client: LoadClient, sequential: int = SEQUENTIAL_REQUESTS) -> OverloadOutcome:
    """``OVERLOAD_REQUESTS`` streams at once against a small KV cache, then ``sequential``
    one-token requests one after another."""
    start = time.monotonic()
    load = StreamingLoad(client, OVERLOAD_MAX_TOKENS, salt=f"overload-{uuid.uuid4().hex}")
    load.add_all(document_prompts(OVERLOAD_REQUESTS, OVERLOAD_WORDS, tag="overload"))
    outcome = OverloadOutcome(await load.results(600))
    one_word = Prompt("Say yes.", system="You answer in one word.")
    for i in range(sequential):
        outcome.sequential.append(await client.stream(one_word, 1, salt=f"seq-{i % 4}", ignore_eos=False))
    outcome.seconds = time.monotonic() - start
    return outcome
