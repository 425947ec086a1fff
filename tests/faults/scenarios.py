"""Each fault as one scenario against a running stack, shared by the tests and loadtest/faults.py.

A scenario starts streaming load, signals one service at a chosen moment, collects what every
client saw, and measures recovery: the seconds from the signal until the service runs again as a
new process, every service answers /health, the gateway sees every engine and a request succeeds.
Tests assert on the ``FaultOutcome``; the benchmark prints it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import time
import uuid
from dataclasses import dataclass, field

from tests.faults.load import LoadClient, Prompt, StreamingLoad, StreamResult, document_prompts, story_prompts
from tests.faults.stack import FaultStack, StackError

log = logging.getLogger(__name__)

STREAMS = 6            # concurrent streams under every fault (the issue measured 4-8)
MAX_TOKENS = 128       # per stream: long enough to be mid-stream when the fault lands
MIN_CHUNKS = 8         # a stream is "open" once it has this many content chunks
RECOVERY_TIMEOUT_S = 90
STALL_LIMIT_S = 5.0    # the longest gap between two chunks a fault may cause
MIGRATIONS = "crescent_gateway_migrations_total"
HELD_GAUGES = ("crescent_engine_running_requests", "crescent_engine_queue_depth")  # what an engine holds
PROBE = Prompt("Say one word.", system="You answer in one word.")
PREFILL_STREAMS = 4
PREFILL_WORDS = 600    # about 900 prompt tokens: a second or more of prefill each on a CPU
PREFILL_MAX_TOKENS = 24


@dataclass
class FaultOutcome:
    fault: str                                   # e.g. "decode SIGKILL"
    target: str                                  # the service signalled, e.g. "decode-1"
    signalled_at: float                          # monotonic
    streams: list[StreamResult]
    references: dict[Prompt, str]
    probes: list[StreamResult] = field(default_factory=list)   # new requests during the outage
    gateway_health: list[int | None] = field(default_factory=list)  # /health statuses meanwhile
    target_health: list[int | None] = field(default_factory=list)   # the target's, right after a SIGTERM
    recovery_s: float | None = None
    recovery_error: str | None = None             # why the stack did not come back
    kv_freed_s: float | None = None
    kv_at_fault: float = 0.0                     # decode KV in use (tokens) just before the fault
    scheduler_freed_s: float | None = None       # until the scheduler's view shows that KV free
    migrations: float = 0.0
    waiting_at_signal: int = 0                   # streams without a first token when signalled
    held_at_signal: int | None = None            # requests the target held (running + queued) when signalled
    # Re-placements of each stream (its completion id), from the gateway's log: unlike
    # ``migrations`` (the gateway's counter), they leave out the recovery's health probes.
    replaced: dict[str, int] = field(default_factory=dict)

    def mismatched(self) -> list[str]:
        """Completed streams whose text differs from the uninterrupted reference run."""
        return [f"{r.prompt.user!r}: got {len(r.text)} chars, reference {len(self.references[r.prompt])}; "
                f"first difference at char {_first_difference(r.text, self.references[r.prompt])}"
                for r in self.streams if r.completed and r.prompt in self.references
                and r.text != self.references[r.prompt]]

    def incomplete(self) -> list[str]:
        return [r.describe() for r in self.streams if not r.completed]

    def summary(self) -> str:
        completed = sum(r.completed for r in self.streams)
        refused = sum(p.status == 503 for p in self.probes)
        return (f"{self.fault} on {self.target}: {completed}/{len(self.streams)} streams completed, "
                f"{len(self.mismatched())} differ from the reference, {self.migrations:.0f} migrations "
                f"({sum(self.replaced.values())} of them the streams', {len(self.replaced)} streams re-placed)"
                f"{'' if self.held_at_signal is None else f' ({self.held_at_signal} requests held by the target)'}, "
                f"error events {sum(r.error_event for r in self.streams)}, probes {len(self.probes)} "
                f"({refused} x 503), worst stall {self.worst_stall_s():.2f} s, recovery {self.recovery_s} s, "
                f"KV freed {self.kv_freed_s} s (held {self.kv_at_fault:.0f} tokens at the fault; "
                f"the scheduler saw it free after {self.scheduler_freed_s} s)")

    def worst_stall_s(self) -> float:
        """The longest gap between two chunks that ended after the signal, over all streams."""
        return max((r.max_gap(after=self.signalled_at) for r in self.streams), default=0.0)


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# Greedy output depends only on the model and the prompt: one reference run serves every stack.
_REFERENCES: dict[tuple[Prompt, int], str] = {}


async def reference_texts(stack: FaultStack, client: LoadClient, prompts: list[Prompt],
                          max_tokens: int = MAX_TOKENS) -> dict[Prompt, str]:
    """The texts of an uninterrupted run of ``prompts`` (temperature 0), run once per session.
    Its own cache salt keeps the fault run from reusing the reference's prefix blocks."""
    cache = _REFERENCES
    missing = [p for p in prompts if (p, max_tokens) not in cache]
    if missing:
        load = StreamingLoad(client, max_tokens, salt=f"reference-{uuid.uuid4().hex}")
        load.add_all(missing)
        for r in await load.results():
            if not r.completed:
                raise StackError(f"the reference run failed without any fault: {r.describe()}")
            cache[(r.prompt, max_tokens)] = r.text
    return {p: cache[(p, max_tokens)] for p in prompts}


async def wait_recovered(stack: FaultStack, name: str, old_pid: int, since: float,
                         timeout_s: float = RECOVERY_TIMEOUT_S) -> float:
    """Seconds from ``since`` until ``name`` runs as a new process and the whole stack is healthy."""
    deadline = since + timeout_s
    while (pid := stack.pid(name)) in (None, old_pid):
        if time.monotonic() > deadline:
            raise StackError(f"{name} was not restarted within {timeout_s:.0f} s\n{stack.log_tail('up')}\n"
                             f"{stack.log_tail(name)}")
        await asyncio.sleep(0.1)
    log.info("%s runs again as pid %d", name, pid)
    await asyncio.to_thread(stack.wait_healthy, max(deadline - time.monotonic(), 1.0))
    return time.monotonic() - since


async def watch_health(stack: FaultStack, name: str, into: list[int | None], stop: asyncio.Event,
                       every_s: float = 0.2) -> None:
    while not stop.is_set():
        status, _ = await asyncio.to_thread(stack.health, name)
        into.append(status)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


def migrations_since(stack: FaultStack, before: float) -> float:
    """Re-placements counted by the gateway since it read ``before`` (a restarted gateway counts
    from zero again: then its own count)."""
    after = stack.metric("gateway", MIGRATIONS) or 0.0
    return after - before if after >= before else after


# The line the gateway logs for each re-placement (services/gateway/attempts/migration.py).
REPLACED = re.compile(r"placing (chatcmpl-[0-9a-f]+) again \(")


def replacements(stack: FaultStack, streams: list[StreamResult]) -> dict[str, int]:
    """How often the gateway placed each of ``streams`` again (those never re-placed: absent)."""
    ids = {r.completion_id for r in streams if r.completion_id}
    counts: dict[str, int] = {}
    for match in REPLACED.finditer((stack.run_dir / "gateway.log").read_text(errors="replace")):
        if match.group(1) in ids:
            counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts


async def finish_recovery(outcome: FaultOutcome, recovery: asyncio.Task[float]) -> None:
    try:
        outcome.recovery_s = await recovery
    except StackError as exc:
        outcome.recovery_error = str(exc)


def busiest(stack: FaultStack, role: str, metric: str) -> str:
    """The instance of ``role`` with the most of ``metric`` now (the one a fault should hit)."""
    values = {name: stack.metric(name, metric) or 0.0 for name in stack.names(role)}
    return max(values, key=values.get)


async def streams_under_fault(stack: FaultStack, client: LoadClient, fault: str, target: str | None,
                              sig: signal.Signals, *, role: str = "", prompts: list[Prompt] | None = None,
                              max_tokens: int = MAX_TOKENS, late_prompts: list[Prompt] = (),
                              watch_target_health: bool = False) -> FaultOutcome:
    """Open streams, signal ``target`` (or the ``role`` instance holding the most KV) mid-stream,
    start ``late_prompts`` right after the signal, and wait for every stream and the recovery."""
    prompts = prompts if prompts is not None else story_prompts(STREAMS)
    references = await reference_texts(stack, client, [*prompts, *late_prompts], max_tokens)
    migrations_before = stack.metric("gateway", MIGRATIONS) or 0.0
    load = StreamingLoad(client, max_tokens, salt=f"fault-{uuid.uuid4().hex}")
    load.add_all(prompts)
    await load.wait_streaming(MIN_CHUNKS)
    if target is None:
        target = busiest(stack, role, "crescent_engine_kv_used_tokens")
    held = sum(int(stack.metric(target, gauge) or 0) for gauge in HELD_GAUGES)
    stop_watching = asyncio.Event()
    target_health: list[int | None] = []
    old_pid = stack.signal(target, sig)
    signalled_at = time.monotonic()
    watcher = (asyncio.create_task(watch_health(stack, target, target_health, stop_watching, 0.1))
               if watch_target_health else None)
    for prompt in late_prompts:
        load.add(prompt)
    recovery = asyncio.create_task(wait_recovered(stack, target, old_pid, signalled_at))
    streams = await load.results()
    stop_watching.set()
    if watcher is not None:
        await watcher
    outcome = FaultOutcome(fault, target, signalled_at, streams, references, target_health=target_health,
                           held_at_signal=held)
    await finish_recovery(outcome, recovery)
    outcome.migrations = migrations_since(stack, migrations_before)
    outcome.replaced = replacements(stack, streams)
    log.info(outcome.summary())
    return outcome


async def scheduler_outage(stack: FaultStack, client: LoadClient, sig: signal.Signals,
                           streams: int = 4) -> FaultOutcome:
    """Open streams, signal the scheduler, and send a new request every 0.25 s (and read the
    gateway's /health) until the scheduler is back and the stack is healthy again."""
    prompts = story_prompts(streams)
    references = await reference_texts(stack, client, prompts)
    load = StreamingLoad(client, MAX_TOKENS, salt=f"fault-{uuid.uuid4().hex}")
    load.add_all(prompts)
    await load.wait_streaming(MIN_CHUNKS)
    old_pid = stack.signal("scheduler", sig)
    signalled_at = time.monotonic()
    recovery = asyncio.create_task(wait_recovered(stack, "scheduler", old_pid, signalled_at))
    stop_watching = asyncio.Event()
    gateway_health: list[int | None] = []
    watcher = asyncio.create_task(watch_health(stack, "gateway", gateway_health, stop_watching))
    probes: list[StreamResult] = []
    while not recovery.done():
        probes.append(await client.stream(PROBE, 4, salt="probe"))
        await asyncio.sleep(0.25)
    stop_watching.set()
    await watcher
    outcome = FaultOutcome(f"scheduler {sig.name}", "scheduler", signalled_at, await load.results(), references,
                           probes=probes, gateway_health=gateway_health)
    await finish_recovery(outcome, recovery)
    log.info(outcome.summary())
    return outcome


async def busy_prefill(stack: FaultStack, timeout_s: float = 30) -> str:
    """The first prefill instance seen working on a request (its queue gauge counts the one it runs)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name in stack.names("prefill"):
            if (stack.metric(name, "crescent_engine_queue_depth") or 0) > 0:
                return name
        await asyncio.sleep(0.05)
    raise StackError("no prefill instance was seen busy")


async def prefill_fault(stack: FaultStack, client: LoadClient, sig: signal.Signals) -> FaultOutcome:
    """Long prompts nobody sent before, so that requests wait for their first token; signal a
    prefill instance while it computes one."""
    prompts = document_prompts(PREFILL_STREAMS, PREFILL_WORDS)
    references = await reference_texts(stack, client, prompts, PREFILL_MAX_TOKENS)
    load = StreamingLoad(client, PREFILL_MAX_TOKENS, salt=f"fault-{uuid.uuid4().hex}")
    load.add_all(prompts)
    target = await busy_prefill(stack)
    waiting = sum(not r.chunks for r in load.records)
    migrations_before = stack.metric("gateway", MIGRATIONS) or 0.0
    old_pid = stack.signal(target, sig)
    signalled_at = time.monotonic()
    recovery = asyncio.create_task(wait_recovered(stack, target, old_pid, signalled_at))
    outcome = FaultOutcome(f"prefill {sig.name}", target, signalled_at, await load.results(), references,
                           waiting_at_signal=waiting)
    outcome.migrations = migrations_since(stack, migrations_before)
    await finish_recovery(outcome, recovery)
    log.info(outcome.summary())
    return outcome
