"""The placement policies, selectable by name.

``random``, ``round_robin`` and ``least_loaded`` ignore where KV lives when choosing (they still
reuse whatever the chosen instance can reach); ``cache_aware`` minimises predicted TTFT counting
only each instance's own cache; ``kvcache_centric`` is Mooncake's Algorithm 1: it also counts
prefixes held by peers, pulls one when it beats the local prefix by more than a threshold and
moving it is cheaper than recomputing (the puller keeps it: hot prefixes replicate), and picks
decode by predicted time between tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from crescent.services.scheduler.cost_model import CostModels
from crescent.services.scheduler.datatypes import Slo
from crescent.services.scheduler.placement import DecodeEstimate, Policy, PolicyOptions, PrefillPlan, PrefillPlanner


class UnknownPolicyError(ValueError):
    """A policy name that is not registered; the message lists the valid ones."""


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, costs: CostModels, slo: Slo, options: PolicyOptions = PolicyOptions()) -> None:
        super().__init__(costs, slo, options)
        self._rng = random.Random(options.seed)

    def choose_prefill(self, planner: PrefillPlanner) -> PrefillPlan:
        return planner.plan(self._rng.choice(planner.view.prefill), peers=False)

    def choose_decode(self, fitting: Sequence[DecodeEstimate]) -> DecodeEstimate:
        return self._rng.choice(fitting)


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, costs: CostModels, slo: Slo, options: PolicyOptions = PolicyOptions()) -> None:
        super().__init__(costs, slo, options)
        self._next_prefill = 0
        self._next_decode = 0

    def choose_prefill(self, planner: PrefillPlanner) -> PrefillPlan:
        # Order by id so the rotation survives instances joining and leaving.
        ordered = sorted(planner.view.prefill, key=lambda c: c.instance_id)
        chosen = ordered[self._next_prefill % len(ordered)]
        self._next_prefill += 1
        return planner.plan(chosen, peers=False)

    def choose_decode(self, fitting: Sequence[DecodeEstimate]) -> DecodeEstimate:
        ordered = sorted(fitting, key=lambda e: e.candidate.instance_id)
        chosen = ordered[self._next_decode % len(ordered)]
        self._next_decode += 1
        return chosen


class LeastLoadedPolicy(Policy):
    name = "least_loaded"

    def choose_prefill(self, planner: PrefillPlanner) -> PrefillPlan:
        chosen = min(planner.view.prefill, key=lambda c: (c.queue_s, c.queued_requests, c.instance_id))
        return planner.plan(chosen, peers=False)


class CacheAwarePolicy(Policy):
    """Minimum predicted TTFT with each instance's own cache (and shared kvstores) only."""

    name = "cache_aware"

    def choose_prefill(self, planner: PrefillPlanner) -> PrefillPlan:
        plans = (planner.plan(c, peers=False) for c in planner.view.prefill)
        return min(plans, key=lambda p: (p.ttft_s, p.candidate.queue_s, p.candidate.queued_requests, p.candidate.instance_id))


class KvCacheCentricPolicy(Policy):
    """Mooncake Algorithm 1: TTFT = transfer(remote prefix) + queue + prefill(uncached); minimum wins."""

    name = "kvcache_centric"

    def choose_prefill(self, planner: PrefillPlanner) -> PrefillPlan:
        plans = (planner.plan(c, peers=True) for c in planner.view.prefill)
        return min(plans, key=lambda p: (p.ttft_s, p.candidate.queue_s, p.candidate.queued_requests, p.candidate.instance_id))

    def choose_decode(self, fitting: Sequence[DecodeEstimate]) -> DecodeEstimate:
        return min(fitting, key=lambda e: e.tbt_s)


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (RandomPolicy, RoundRobinPolicy, LeastLoadedPolicy, CacheAwarePolicy, KvCacheCentricPolicy)
}


def make_policy(name: str, costs: CostModels, slo: Slo, options: PolicyOptions = PolicyOptions()) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)}") from None
    return cls(costs, slo, options)
