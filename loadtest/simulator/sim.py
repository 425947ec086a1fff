"""The discrete-event loop: arrivals, placement by the real Conductor, prefill, handoff, decode.

Time advances from event to event. The live scheduler's ``Conductor`` runs on the simulated
clock: simulated instances register with it, report their load every ``heartbeat_interval_s``
(with the request ids they hold, as live instances do), publish their blocks to its index, and
it admits and places every request with the same reservations and policy as in production.
Prefill nodes run their queue first in, first out, in chunks of ``chunk_tokens``; each finished
chunk publishes its complete blocks, so peers can pull them. Decode nodes run continuous
batching: requests join and leave between steps. Cost models give every duration.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from crescent.services.contract.block_keys import BlockKey
from crescent.services.contract.latency import tbt_seconds
from crescent.services.scheduler.conductor import Conductor
from crescent.services.scheduler.config import SchedulerSettings
from crescent.services.scheduler.cost_model import CostModels
from crescent.services.scheduler.cost_presets import paper_cost_models
from crescent.services.scheduler.datatypes import Decision, InstanceId, Placement, Role, Tier
from crescent.services.scheduler.registry import InstanceSpec
from loadtest.simulator.nodes import BlockCache, DecodeNode, PrefillNode, SimRequest
from loadtest.simulator.report import SimOutcome
from loadtest.simulator.trace import TRACE_BLOCK_TOKENS, TraceRequest


@dataclass(frozen=True, slots=True)
class SimConfig:
    policy: str = "kvcache_centric"
    prefill_instances: int = 16
    decode_instances: int = 16
    colocated: bool = False             # prefill_instances + decode_instances nodes that do both
    prefix_caching: bool = True
    global_cache: bool = True           # prefill instances may pull prefixes from peers' caches
    cache_capacity_tokens: int | None = 3_000_000  # per prefill instance; None: unbounded
    block_size: int = TRACE_BLOCK_TOKENS
    chunk_tokens: int = 8192
    decode_max_batch: int = 128
    decode_kv_capacity_tokens: int = 1_500_000
    slo_ttft_s: float = 30.0
    slo_tbt_s: float = 0.1
    reject_early: bool = False
    decode_wait_in_tbt: bool = False    # the scheduler's slo.decode_wait_in_tbt
    remote_threshold_blocks: int = 2
    # KV streams to decode layer by layer while prefill runs (Mooncake); only this share of the
    # full transfer remains after the last layer. 1.0: transfer it all after prefill.
    handoff_share: float = 1 / 80
    heartbeat_interval_s: float = 1.0   # how often instances report their load, as live
    seed: int = 0


def _key(hash_id: int) -> BlockKey:
    return BlockKey(hash_id.to_bytes(8, "little", signed=True))


def scheduler_settings(config: SimConfig) -> SchedulerSettings:
    """The live scheduler's settings for a simulated cluster whose reports are never lost."""
    forever = 1e12
    return SchedulerSettings.model_validate({
        "heartbeat_timeout_s": forever,
        "reservation_timeout_s": forever,
        "block_size": config.block_size,
        "policy": {"name": config.policy, "seed": config.seed,
                   "remote_prefix_threshold_blocks": config.remote_threshold_blocks,
                   "allow_remote_prefix": config.global_cache and config.prefix_caching},
        "slo": {"ttft_s": config.slo_ttft_s, "tbt_s": config.slo_tbt_s, "reject_early": config.reject_early,
                "decode_wait_in_tbt": config.decode_wait_in_tbt},
        "index": {"max_blocks": 1 << 40},
    })


class Simulation:
    def __init__(self, config: SimConfig, costs: CostModels | None = None) -> None:
        self.config = config
        self.costs = costs or paper_cost_models()
        self.now = 0.0
        self.conductor = Conductor(scheduler_settings(config), clock=lambda: self.now, costs=self.costs)
        self.index = self.conductor.index  # nodes' block events land here, as published live
        self.policy = self.conductor.policy
        capacity = None if config.cache_capacity_tokens is None else max(config.cache_capacity_tokens // config.block_size, 1)
        self.prefill = {f"p{i}": PrefillNode(f"p{i}", BlockCache(capacity)) for i in range(config.prefill_instances)}
        self.decode = {
            f"d{i}": DecodeNode(f"d{i}", config.decode_max_batch, config.decode_kv_capacity_tokens)
            for i in range(config.decode_instances)
        }
        for node_id in self.prefill:
            self.conductor.register(InstanceSpec(InstanceId(node_id), Role.PREFILL, node_id, "", config.block_size, 0, 0))
        for node_id, d in self.decode.items():
            self.conductor.register(InstanceSpec(InstanceId(node_id), Role.DECODE, node_id, "", config.block_size,
                                                 d.kv_capacity_tokens, d.max_batch))
        self._last_report = -math.inf
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self.records: list[SimOutcome] = []

    # ---- event plumbing --------------------------------------------------------------------

    _ARRIVE, _CHUNK, _HANDOFF, _STEP = range(4)

    def _at(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self, trace: Sequence[TraceRequest]) -> list[SimOutcome]:
        for r in trace:
            self._at(r.arrival_s, self._ARRIVE, r)
        handlers: tuple[Callable[[Any], None], ...] = (self._arrive, self._chunk_done, self._handoff_done, self._step_done)
        while self._events:
            self.now, _, kind, payload = heapq.heappop(self._events)
            handlers[kind](payload)
        self.records.sort(key=lambda rec: rec.index)
        return self.records

    # ---- arrival and placement -------------------------------------------------------------

    def _report_loads(self) -> None:
        """Every instance's heartbeat, at most every ``heartbeat_interval_s`` (arrivals decide when)."""
        if self.now - self._last_report < self.config.heartbeat_interval_s:
            return
        self._last_report = self.now
        for p in self.prefill.values():
            self.conductor.heartbeat(InstanceId(p.node_id), p.report())
        for d in self.decode.values():
            self.conductor.heartbeat(InstanceId(d.node_id), d.report())

    def _decide(self, req: SimRequest) -> Decision:
        self._report_loads()
        keys = req.keys if self.config.prefix_caching else ()
        return self.conductor.place(str(req.index), "", keys, req.input_length, req.output_length)

    def _arrive(self, tr: TraceRequest) -> None:
        req = SimRequest(tr.index, tr.arrival_s, tr.input_length, tr.output_length, tuple(_key(h) for h in tr.hash_ids))
        decision = self._decide(req)
        if not isinstance(decision, Placement):
            self.records.append(SimOutcome.rejected(req, decision.reason))
            return
        self._assign(req, decision)

    def _assign(self, req: SimRequest, p: Placement) -> None:
        node = self.prefill[p.prefill]
        req.prefill, req.decode, req.local_blocks = p.prefill, p.decode, p.local_blocks
        if p.pull is not None:
            req.pull_source, req.pull_blocks = p.pull.source, p.pull.blocks
        req.expected_compute = req.input_length - (self._cached_tokens(req, p.cached_blocks) if p.cached_blocks else 0)
        node.queue.append(req)
        if node.current is None:
            self._start_next(node)

    # ---- prefill ---------------------------------------------------------------------------

    def _cached_tokens(self, req: SimRequest, blocks: int) -> int:
        return min(blocks * self.config.block_size, req.input_length - 1)

    def _start_next(self, node: PrefillNode) -> None:
        if not node.queue:
            node.current = None
            return
        req = node.queue.popleft()
        node.current = req
        reuse, transfer_s = 0, 0.0
        if self.config.prefix_caching:
            reuse = node.cache.prefix(req.keys)
            if req.pull_source:
                source = self.prefill[req.pull_source]
                available = source.cache.prefix(req.keys[: req.pull_blocks], touch=False)
                if available > reuse:
                    cached_before = self._cached_tokens(req, reuse)
                    transfer_s = self.costs.transfer.seconds(self._cached_tokens(req, available) - cached_before, Tier.ENGINE)
                    self._store(node, req.keys[reuse:available])  # the puller keeps them: replication
                    reuse = available
        req.reused_blocks = reuse
        req.cached_tokens = self._cached_tokens(req, reuse) if reuse else 0
        req.computed_tokens = req.input_length - req.cached_tokens
        req.done_tokens = 0
        self._next_chunk(node, req, transfer_s + self.costs.prefill.fixed_s)

    def _next_chunk(self, node: PrefillNode, req: SimRequest, extra_s: float = 0.0) -> None:
        chunk = min(self.config.chunk_tokens, req.computed_tokens - req.done_tokens)
        context = req.cached_tokens + req.done_tokens
        seconds = self.costs.prefill.seconds(chunk, context) - self.costs.prefill.fixed_s
        node.busy_s += seconds
        req.done_tokens += chunk
        req.chunk_tokens = chunk
        self._at(self.now + extra_s + seconds, self._CHUNK, node)

    def _chunk_done(self, node: PrefillNode) -> None:
        req = node.current
        assert req is not None
        req.chunk_tokens = 0
        complete = (req.cached_tokens + req.done_tokens) // self.config.block_size
        if self.config.prefix_caching:
            self._store(node, req.keys[:complete])
        if req.done_tokens < req.computed_tokens:
            self._next_chunk(node, req)
            return
        if self.config.prefix_caching:
            self._store(node, req.keys)  # the last, partial block too: the trace names it
        req.first_token_s = req.last_token_s = self.now
        node.finished.append(str(req.index))
        # The gateway's outcome report: a request that ends at its first token never reaches decode.
        self.conductor.outcome(str(req.index), self.now - req.arrival_s, released=req.output_length <= 1)
        handoff = self.costs.transfer.seconds(req.input_length, Tier.ENGINE) * self.config.handoff_share
        self._at(self.now + handoff, self._HANDOFF, req)
        self._start_next(node)

    def _store(self, node: PrefillNode, keys: Sequence[BlockKey]) -> None:
        added, evicted = node.cache.insert(keys)
        if evicted:
            self.index.remove(node.node_id, evicted)
        if added:
            self.index.store(node.node_id, added, Tier.ENGINE)

    # ---- decode ----------------------------------------------------------------------------

    def _handoff_done(self, req: SimRequest) -> None:
        d = self.decode[req.decode]
        if req.output_length <= 1:
            self._finish(req)
            return
        d.waiting.append(req)
        if not d.stepping:
            self._start_step(d)

    def _start_step(self, d: DecodeNode) -> None:
        d.admit()
        if not d.running:
            d.stepping = False
            return
        d.stepping = True
        self._at(self.now + self.costs.decode.step_seconds(len(d.running), d.context), self._STEP, d)

    def _step_done(self, d: DecodeNode) -> None:
        still: list[SimRequest] = []
        for req in d.running:
            req.intervals.append(self.now - req.last_token_s)
            req.last_token_s = self.now
            req.generated += 1
            d.context += 1
            if req.generated >= req.output_length - 1:
                d.kv_used -= req.kv_tokens
                d.context -= req.input_length + req.generated
                d.finished.append(str(req.index))
                self._finish(req)
            else:
                still.append(req)
        d.running = still
        self._start_step(d)

    def _finish(self, req: SimRequest) -> None:
        req.finish_s = self.now
        req.tbt_s = tbt_seconds(req.intervals)
        req.intervals = []
        self.records.append(SimOutcome.completed(req))


def simulate(trace: Sequence[TraceRequest], config: SimConfig, costs: CostModels | None = None) -> list[SimOutcome]:
    if config.colocated:
        from loadtest.simulator.colocated import ColocatedSimulation

        return ColocatedSimulation(config, costs).run(trace)
    return Simulation(config, costs).run(trace)
