"""Placement policies: the scheduling core shared by the live service and the simulator.

A policy sees a request and a ``ClusterView`` (live instances, their predicted queues, the
prefix index) and returns a ``Placement`` or a ``Rejection``. It keeps no clock and does no
I/O, so the simulator runs exactly the code the service runs.

Sources of reusable KV for a prefill instance, cheapest first:
- its own cache (``local``);
- shared sources (kvstore nodes), which every prefill instance reads on its own;
- peers' caches, pulled only by policies that plan remote prefixes (``kvcache_centric``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from crescent.services.scheduler.cost_model import CostModels
from crescent.services.scheduler.datatypes import (
    DecodeCandidate,
    Decision,
    Placement,
    PlacementRequest,
    PrefillCandidate,
    PrefixMatch,
    PrefixPull,
    Rejection,
    Slo,
    SourceId,
    Tier,
)
from crescent.services.scheduler.prefix_index import PrefixIndex

MIN_RETRY_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    seed: int = 0
    remote_prefix_threshold_blocks: int = 2
    allow_remote_prefix: bool = True
    no_instance_retry_after_s: float = 2.0
    tbt_retry_after_s: float = 2.0


@dataclass(frozen=True, slots=True)
class ClusterView:
    prefill: Sequence[PrefillCandidate]
    decode: Sequence[DecodeCandidate]
    index: PrefixIndex
    shared_sources: frozenset[SourceId] = field(default_factory=frozenset)


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    candidate: PrefillCandidate
    local_blocks: int
    pull: PrefixPull | None
    ttft_s: float


class Policy(ABC):
    """Base: rejection when a role is empty, prefix planning, decode choice and SLO checks."""

    name: str = ""

    def __init__(self, costs: CostModels, slo: Slo, options: PolicyOptions = PolicyOptions()) -> None:
        self.costs = costs
        self.slo = slo
        self.options = options

    def place(self, request: PlacementRequest, view: ClusterView) -> Decision:
        if not view.prefill:
            return Rejection("no_prefill_instance", "no prefill instance is registered", self.options.no_instance_retry_after_s)
        if not view.decode:
            return Rejection("no_decode_instance", "no decode instance is registered", self.options.no_instance_retry_after_s)
        match = view.index.match(request.block_keys) if request.block_keys else PrefixMatch()
        planner = PrefillPlanner(self, request, view, match)
        prefill = self.choose_prefill(planner)
        decode, tbt = self.choose_decode(request, view.decode)
        if self.slo.reject_early:
            if decode is None:
                return Rejection("decode_kv_full", "no decode instance has room for this request", self.options.tbt_retry_after_s)
            if prefill.ttft_s > self.slo.ttft_s:
                wait = max(MIN_RETRY_AFTER_S, math.ceil(prefill.ttft_s - self.slo.ttft_s))
                return Rejection(
                    "ttft_slo",
                    f"predicted time to first token {prefill.ttft_s:.2f}s exceeds the SLO of {self.slo.ttft_s:g}s",
                    float(wait),
                )
            if tbt > self.slo.tbt_s:
                return Rejection(
                    "tbt_slo",
                    f"predicted time between tokens {tbt:.3f}s exceeds the SLO of {self.slo.tbt_s:g}s",
                    self.options.tbt_retry_after_s,
                )
        if decode is None:  # no room anywhere and no early rejection: queue at the least loaded
            decode = min(view.decode, key=lambda d: (d.batch_size, d.context_tokens))
            tbt = self.predicted_tbt(decode, request)
        return Placement(
            prefill=prefill.candidate.instance_id,
            decode=decode.instance_id,
            local_blocks=prefill.local_blocks,
            pull=prefill.pull,
            predicted_ttft_s=prefill.ttft_s,
            predicted_tbt_s=tbt,
        )

    @abstractmethod
    def choose_prefill(self, planner: PrefillPlanner) -> PrefillPlan: ...

    def choose_decode(
        self, request: PlacementRequest, decode: Sequence[DecodeCandidate]
    ) -> tuple[DecodeCandidate | None, float]:
        """Default: the least loaded decode instance with room; returns it and its predicted TBT."""
        fits = [d for d in decode if fits_decode(d, request)]
        if not fits:
            return None, math.inf
        best = min(fits, key=lambda d: (d.batch_size, d.context_tokens))
        return best, self.predicted_tbt(best, request)

    def predicted_tbt(self, d: DecodeCandidate, request: PlacementRequest) -> float:
        # Over its life the request sits in a batch one larger, with its prompt plus half its output.
        context = d.context_tokens + request.prompt_tokens + request.max_tokens // 2
        return self.costs.decode.step_seconds(d.batch_size + 1, context)


def fits_decode(d: DecodeCandidate, request: PlacementRequest) -> bool:
    if d.max_batch_size and d.batch_size >= d.max_batch_size:
        return False
    return d.free_kv_tokens is None or d.free_kv_tokens >= request.prompt_tokens + request.max_tokens


class PrefillPlanner:
    """Predicts TTFT per prefill instance for one request; caches per-request work."""

    def __init__(self, policy: Policy, request: PlacementRequest, view: ClusterView, match: PrefixMatch) -> None:
        self.policy = policy
        self.request = request
        self.view = view
        self.match = match
        costs = policy.costs
        self._prefill = costs.prefill
        self._transfer = costs.transfer
        self._shared = self._best_among(view.shared_sources)
        ranked = sorted(
            ((n, s) for s, n in match.by_source.items() if s not in view.shared_sources), reverse=True
        )
        self._peers = ranked[:2]  # the best and runner-up: the best cannot pull from itself
        self._cumulative: dict[SourceId, list[float]] = {}

    def _best_among(self, sources: frozenset[SourceId]) -> tuple[SourceId | None, int]:
        best: tuple[SourceId | None, int] = (None, 0)
        for src in sources:
            n = self.match.blocks(src)
            if n > best[1]:
                best = (src, n)
        return best

    def _tokens(self, blocks: int) -> int:
        # The last prompt token is always computed: its logits give the first output token.
        return min(blocks * self.request.block_size, max(self.request.prompt_tokens - 1, 0))

    def _pull_seconds(self, source: SourceId, start: int, end: int) -> float:
        cumulative = self._cumulative.get(source)
        if cumulative is None:  # once per source and request: seconds to move blocks [0, i)
            block_s = {t: self._transfer.seconds_per_token(t) * self.request.block_size for t in Tier}
            cumulative = [0.0]
            for tier in self.view.index.tiers(source, self.request.block_keys[:end]):
                cumulative.append(cumulative[-1] + block_s[tier])
            self._cumulative[source] = cumulative
        return self._transfer.latency_s + cumulative[end] - cumulative[start]

    def plan(self, c: PrefillCandidate, peers: bool) -> PrefillPlan:
        local = self.match.blocks(c.instance_id)
        best = self._compute(c, local, None)
        options: list[tuple[SourceId | None, int]] = [self._shared]
        if peers and self.policy.options.allow_remote_prefix:
            options += [(s, n) for n, s in self._peers if s != c.instance_id][:1]
        for source, blocks in options:
            if source is None or blocks <= local:
                continue
            if source not in self.view.shared_sources and blocks - local <= self.policy.options.remote_prefix_threshold_blocks:
                continue
            plan = self._compute(c, local, PrefixPull(source, blocks, self._pull_seconds(source, local, blocks)))
            if plan.ttft_s < best.ttft_s:
                best = plan
        return best

    def _compute(self, c: PrefillCandidate, local: int, pull: PrefixPull | None) -> PrefillPlan:
        cached = self._tokens(pull.blocks if pull else local)
        ttft = (pull.seconds if pull else 0.0) + c.queue_s + self._prefill.seconds(self.request.prompt_tokens - cached, cached)
        return PrefillPlan(c, local, pull, ttft)
