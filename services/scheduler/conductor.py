"""The Conductor: the live scheduler's state and decisions, without the network.

Owns the instance registry, the global prefix index and the policy. The gRPC servicer only
converts messages; tests and benchmarks drive this class directly too.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from crescent.services.common.block_keys import BlockKey
from crescent.services.scheduler.config import SchedulerSettings
from crescent.services.scheduler.cost_model import CostModels
from crescent.services.scheduler.cost_presets import cost_models_from_settings
from crescent.services.scheduler.datatypes import (
    DecodeCandidate,
    Decision,
    InstanceId,
    Placement,
    PlacementRequest,
    PrefillCandidate,
    Rejection,
    Role,
    Slo,
    SourceId,
    Tier,
)
from crescent.services.scheduler.policies import make_policy
from crescent.services.scheduler.policy import ClusterView, PolicyOptions
from crescent.services.scheduler.prefix_index import PrefixIndex
from crescent.services.scheduler.registry import InstanceRegistry, InstanceSpec, LoadReport

log = logging.getLogger(__name__)

_REMEMBERED_PREDICTIONS = 100_000  # placements whose predicted TTFT awaits an outcome report


@dataclass(frozen=True, slots=True)
class BlockUpdate:
    stored: bool            # False: removed
    key: BlockKey
    tier: Tier


class Conductor:
    def __init__(self, settings: SchedulerSettings, clock: Callable[[], float] = time.monotonic,
                 costs: CostModels | None = None) -> None:
        self.settings = settings
        self.costs = costs or cost_models_from_settings(settings.cost)
        self.registry = InstanceRegistry(settings.heartbeat_timeout_s, clock)
        self.index = PrefixIndex(settings.index.max_blocks)
        p = settings.policy
        self.policy = make_policy(
            p.name,
            self.costs,
            Slo(settings.slo.ttft_s, settings.slo.tbt_s, settings.slo.reject_early),
            PolicyOptions(
                seed=p.seed,
                remote_prefix_threshold_blocks=p.remote_prefix_threshold_blocks,
                allow_remote_prefix=p.allow_remote_prefix,
                no_instance_retry_after_s=settings.no_instance_retry_after_s,
            ),
        )
        # Sources that sent a full snapshot since this process started: until then the index
        # holds only part of what they have, which can only under-count hits.
        self._snapshotted: set[SourceId] = set()
        self._predictions: OrderedDict[str, float] = OrderedDict()

    # ---- instances -------------------------------------------------------------------------

    def register(self, spec: InstanceSpec) -> bool:
        """Add or replace an instance; returns whether it should send a block snapshot.

        A (re-)registering instance may have restarted with an empty cache, so whatever the
        index held for it is dropped rather than trusted.
        """
        self.registry.register(spec)
        self.index.drop_source(spec.instance_id)
        self._snapshotted.discard(SourceId(spec.instance_id))
        return True

    def heartbeat(self, instance_id: InstanceId, load: LoadReport) -> bool:
        """Record a load report; False when the instance must register again."""
        try:
            self.registry.heartbeat(instance_id, load)
        except KeyError:
            return False
        return True

    def deregister(self, instance_id: InstanceId) -> bool:
        """Drop an instance known to be gone (e.g. its endpoint left), with its index entries."""
        removed = self.registry.remove(instance_id)
        self.index.drop_source(instance_id)
        self._snapshotted.discard(SourceId(instance_id))
        return removed

    def expire(self) -> list[InstanceId]:
        dead = self.registry.expire()
        for instance_id in dead:
            self.index.drop_source(instance_id)
            self._snapshotted.discard(SourceId(instance_id))
        return dead

    # ---- block events ----------------------------------------------------------------------

    def publish(self, source: str, updates: Iterable[BlockUpdate], full_snapshot: bool) -> tuple[int, bool]:
        """Apply events from ``source``; returns (accepted, want_full_snapshot)."""
        updates = list(updates)
        src = SourceId(source)
        if full_snapshot:
            self.index.replace_source(src, ((u.key, u.tier) for u in updates if u.stored))
            self._snapshotted.add(src)
        else:
            stored: dict[Tier, list[BlockKey]] = {}
            removed: list[BlockKey] = []
            for u in updates:
                if u.stored:
                    stored.setdefault(u.tier, []).append(u.key)
                else:
                    removed.append(u.key)
            self.index.remove(src, removed)
            for tier, keys in stored.items():
                self.index.store(src, keys, tier)
        return len(updates), src not in self._snapshotted

    # ---- placement -------------------------------------------------------------------------

    def view(self, model_id: str = "") -> tuple[ClusterView, int]:
        """The cluster as the policy sees it, and the prefill instances' block size."""
        prefill_cost = self.costs.prefill
        prefill, decode = [], []
        block_size = 0
        for r in self.registry.live(Role.PREFILL):
            if model_id and r.spec.model_id != model_id:
                continue
            block_size = block_size or r.spec.block_size
            # Work ahead of a new request: reported queue (and the prompt in progress), plus what
            # this scheduler placed there since the last heartbeat.
            reported = r.load.queued_requests + r.load.running_requests
            reported_tokens = r.load.queued_tokens or reported * self.settings.assumed_prompt_tokens
            queued_tokens = reported_tokens + r.pending_tokens
            queued = reported + r.pending_requests
            # Queued prompts are unknown one by one: treat them as equal shares of the tokens.
            queue_s = queued * prefill_cost.seconds(queued_tokens // queued) if queued else 0.0
            prefill.append(PrefillCandidate(r.spec.instance_id, queue_s, queued, r.spec.address))
        for r in self.registry.live(Role.DECODE):
            if model_id and r.spec.model_id != model_id:
                continue
            decode.append(
                DecodeCandidate(
                    r.spec.instance_id,
                    batch_size=r.load.running_requests + r.load.queued_requests + r.pending_requests,
                    context_tokens=r.load.queued_tokens + r.pending_kv_tokens,
                    free_kv_tokens=(r.load.free_kv_tokens - r.pending_kv_tokens) if r.spec.kv_capacity_tokens > 0 else None,
                    max_batch_size=r.spec.max_batch_size,
                    address=r.spec.address,
                )
            )
        registered = {SourceId(r.spec.instance_id) for r in self.registry.all()}
        shared = frozenset(s for s in self.index.sources() if s not in registered)
        return ClusterView(prefill, decode, self.index, shared), block_size

    def place(self, request_id: str, model_id: str, block_keys: tuple[BlockKey, ...],
              prompt_tokens: int, max_tokens: int) -> Decision:
        view, block_size = self.view(model_id)
        request = PlacementRequest(request_id, block_keys, prompt_tokens, max_tokens, block_size or 1)
        decision = self.policy.place(request, view)
        if isinstance(decision, Rejection) and decision.reason.startswith("no_") and model_id:
            decision = Rejection(decision.reason, f"{decision.message} for model {model_id!r}", decision.retry_after_s)
        if isinstance(decision, Placement):
            cached = min(decision.cached_blocks * request.block_size, prompt_tokens)
            self.registry.note_placed(decision.prefill, prompt_tokens - cached)
            self.registry.note_placed(decision.decode, 0, prompt_tokens + max_tokens)
            self._remember(request_id, decision.predicted_ttft_s)
        return decision

    def _remember(self, request_id: str, predicted_ttft_s: float) -> None:
        if not request_id:
            return
        self._predictions[request_id] = predicted_ttft_s
        if len(self._predictions) > _REMEMBERED_PREDICTIONS:
            self._predictions.popitem(last=False)

    def take_prediction(self, request_id: str) -> float | None:
        """The predicted TTFT of a placed request, once (for predicted-vs-actual metrics)."""
        return self._predictions.pop(request_id, None)
