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


@dataclass(frozen=True, slots=True)
class DecodeEstimate:
    """One decode instance's outlook for one request."""

    candidate: DecodeCandidate
    kv_wait_s: float            # after it arrives, until its KV reservation fits: 0 now, inf never (as far as known)
    slot_wait_s: float          # after it arrives, until a place in the running batch frees
    step_s: float               # the step time of the batch it runs in
    tbt_s: float                # predicted TBT (its waits included when the SLO says so)

    @property
    def fits_now(self) -> bool:
        return self.kv_wait_s == 0.0

    @property
    def wait_s(self) -> float:
        return max(self.kv_wait_s, self.slot_wait_s)

    @property
    def wait_reason(self) -> str:
        return "decode_kv_full" if self.kv_wait_s >= self.slot_wait_s else "decode_batch_full"


class Policy(ABC):
    """Base: rejection when a role is empty, prefix planning, decode choice and SLO checks."""

    name: str = ""

    def __init__(self, costs: CostModels, slo: Slo, options: PolicyOptions = PolicyOptions()) -> None:
        self.costs = costs
        self.slo = slo
        self.options = options

    def place(self, request: PlacementRequest, view: ClusterView) -> Decision:
        if not view.prefill:
            return Rejection("no_prefill_instance", "no prefill instance is registered and taking requests", self.options.no_instance_retry_after_s)
        if not view.decode:
            return Rejection("no_decode_instance", "no decode instance is registered and taking requests", self.options.no_instance_retry_after_s)
        too_big = exceeds_capacity(request, view.decode)
        if too_big is not None:
            return too_big
        match = view.index.match(request.block_keys) if request.block_keys else PrefixMatch()
        # Mooncake Algorithm 1: the prefill instance with the least TTFT, then decode by TBT.
        prefill = self.choose_prefill(PrefillPlanner(self, request, view, match))
        estimates = [self.estimate_decode(d, request, prefill.ttft_s) for d in view.decode]
        now = [e for e in estimates if e.fits_now]
        later = [e for e in estimates if not e.fits_now and math.isfinite(e.kv_wait_s)]
        # An aggregated prefill instance decodes the request itself when it fits there now: no
        # KV moves. Otherwise, if nothing fits now, decode queues it where KV frees first.
        same = next((e for e in now if e.candidate.instance_id == prefill.candidate.instance_id), None)
        decode = same or (self.choose_decode(now) if now else min(later, key=_soonest, default=None))
        if self.slo.reject_early:
            rejection = self._check_slo(prefill, decode)
            if rejection is not None:
                return rejection
        if decode is None:  # no room in sight and no early rejection: queue at the least loaded
            decode = min(estimates, key=lambda e: (e.candidate.batch_size, e.candidate.context_tokens))
        return Placement(
            prefill=prefill.candidate.instance_id,
            decode=decode.candidate.instance_id,
            local_blocks=prefill.local_blocks,
            pull=prefill.pull,
            predicted_ttft_s=prefill.ttft_s,
            predicted_tbt_s=decode.tbt_s,
        )

    def _check_slo(self, prefill: PrefillPlan, decode: DecodeEstimate | None) -> Rejection | None:
        slo = self.slo
        if prefill.ttft_s > slo.ttft_s:
            return Rejection(
                "ttft_slo",
                f"predicted time to first token {prefill.ttft_s:.2f}s exceeds the SLO of {slo.ttft_s:g}s",
                _retry_after(prefill.ttft_s - slo.ttft_s),
            )
        if decode is None:
            return Rejection(
                "decode_kv_full",
                "no decode instance has KV room for this request now, and none is known to free enough of it before "
                f"its wait exceeds the SLO of {slo.ttft_s:g}s",
                self.options.tbt_retry_after_s,
            )
        if prefill.ttft_s + decode.wait_s > slo.ttft_s:
            what = "KV for this request frees" if decode.wait_reason == "decode_kv_full" else "a batch slot frees"
            return Rejection(
                decode.wait_reason,
                f"at decode, {what} in about {decode.wait_s:.1f}s; with a predicted time to first token of "
                f"{prefill.ttft_s:.2f}s that exceeds the SLO of {slo.ttft_s:g}s",
                _retry_after(prefill.ttft_s + decode.wait_s - slo.ttft_s),
            )
        if decode.tbt_s > slo.tbt_s and decode.step_s <= slo.tbt_s:  # the wait breaks it, not the pace
            return Rejection(
                decode.wait_reason,
                f"waiting {decode.wait_s:.1f}s at decode makes the predicted time between tokens "
                f"{decode.tbt_s:.3f}s, which exceeds the SLO of {slo.tbt_s:g}s",
                _retry_after(decode.wait_s),
            )
        if decode.tbt_s > slo.tbt_s:
            return Rejection(
                "tbt_slo",
                f"predicted time between tokens {decode.tbt_s:.3f}s exceeds the SLO of {slo.tbt_s:g}s",
                self.options.tbt_retry_after_s,
            )
        return None

    @abstractmethod
    def choose_prefill(self, planner: PrefillPlanner) -> PrefillPlan: ...

    def choose_decode(self, fitting: Sequence[DecodeEstimate]) -> DecodeEstimate:
        """Among instances where the request fits now (never empty); default: the least loaded."""
        return min(fitting, key=lambda e: (e.candidate.batch_size, e.candidate.context_tokens))

    def estimate_decode(self, d: DecodeCandidate, request: PlacementRequest, arrives_in_s: float = 0.0) -> DecodeEstimate:
        """``arrives_in_s``: when the request reaches decode (its predicted TTFT); what frees
        before then is free for it. Its first token comes from prefill: a wait at decode is a
        stall before the second."""
        need = request.decode_kv_tokens
        kv_wait = 0.0
        if d.free_kv_tokens is not None and d.free_kv_tokens < need:
            if d.kv_capacity_tokens is not None and need > d.kv_capacity_tokens:
                kv_wait = math.inf
            else:
                kv_wait = max(seconds_until_freed(d.releases, need - d.free_kv_tokens) - arrives_in_s, 0.0)
        step, slot_wait = self.decode_step_and_slot_wait(d, request, arrives_in_s)
        tbt = step
        if self.slo.decode_wait_in_tbt:  # Mooncake TBT: the wait is one of its longest 10% intervals
            tbt += max(slot_wait, kv_wait) / max(1, math.ceil(0.1 * max(request.max_tokens - 1, 1)))
        return DecodeEstimate(d, kv_wait, slot_wait, step, tbt)

    def predicted_tbt(self, d: DecodeCandidate, request: PlacementRequest, arrives_in_s: float = 0.0) -> float:
        return self.estimate_decode(d, request, arrives_in_s).tbt_s

    def decode_step_and_slot_wait(self, d: DecodeCandidate, request: PlacementRequest,
                                  arrives_in_s: float) -> tuple[float, float]:
        """The step time of the batch the request joins (at most ``max_batch_size`` run at once)
        and its wait for a place in that batch. Each of its n choices is a row of the batch."""
        batch = d.batch_size + request.sequences
        running = min(batch, d.max_batch_size) if d.max_batch_size else batch
        # Over its life each row sits in the batch with the prompt plus half its output.
        own_context = (request.prompt_tokens + request.max_tokens // 2) * request.sequences
        context = (d.context_tokens + own_context) * running // batch
        step = self.costs.decode.step_seconds(running, context)
        waiting = batch - running
        if not waiting:
            return step, 0.0
        known = [t for t, _ in d.releases]
        slot_free_s = known[waiting - 1] if waiting <= len(known) else max(known[-1] if known else 0.0, waiting * step)
        return step, max(slot_free_s - arrives_in_s, 0.0)


def _soonest(e: DecodeEstimate) -> tuple[float, float]:
    return (e.kv_wait_s, e.tbt_s)


def _retry_after(late_s: float) -> float:
    return float(max(MIN_RETRY_AFTER_S, math.ceil(late_s)))


def seconds_until_freed(releases: Sequence[tuple[float, int]], tokens: int) -> float:
    """When ``tokens`` of KV will have been freed, from (seconds, tokens) releases soonest first."""
    freed = 0
    for seconds, kv in releases:
        freed += kv
        if freed >= tokens:
            return max(seconds, 0.0)
    return math.inf


def exceeds_capacity(request: PlacementRequest, decode: Sequence[DecodeCandidate]) -> Rejection | None:
    """A request larger than every decode instance's whole KV can never run: refused, not queued."""
    capacities = [d.kv_capacity_tokens for d in decode]
    need = request.decode_kv_tokens
    if any(c is None or c >= need for c in capacities):
        return None
    largest = max(c for c in capacities if c is not None)
    if request.n > 1:
        parts = f"{request.n} choices of prompt {request.prompt_tokens} with max_tokens {request.max_tokens} each"
    else:
        parts = f"prompt {request.prompt_tokens} + max_tokens {request.max_tokens}"
    return Rejection(
        "exceeds_kv_capacity",
        f"the request needs {need} tokens of decode KV ({parts}); the largest decode instance holds {largest}",
        0.0,
    )


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
        cost = c.prefill_cost or self._prefill
        ttft = (pull.seconds if pull else 0.0) + c.queue_s + cost.seconds(self.request.prompt_tokens - cached, cached)
        return PrefillPlan(c, local, pull, ttft)
