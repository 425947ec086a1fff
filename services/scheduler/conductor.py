"""The Conductor: the live scheduler's state and decisions, without the network.

Owns the instance registry, the global prefix index and the policy. The gRPC servicer only
converts messages; tests and benchmarks drive this class directly too.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from crescent.services.contract.block_keys import BlockKey
from crescent.services.scheduler.config import SchedulerSettings
from crescent.services.scheduler.cost_model import CostModels, MixedPrefillCost, PrefillCostModel
from crescent.services.scheduler.cost_presets import cost_models_from_settings
from crescent.services.scheduler.decode_outlook import KnownRequest, project_releases
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
from crescent.services.scheduler.output_lengths import OutputLengths
from crescent.services.scheduler.placement import ClusterView, PolicyOptions
from crescent.services.scheduler.prefix_index import PrefixIndex
from crescent.services.scheduler.registry import InstanceRecord, InstanceRegistry, InstanceSpec, LoadReport
from crescent.services.scheduler.reservations import Reservation

log = logging.getLogger(__name__)

_REMEMBERED_PLACEMENTS = 100_000  # placed requests whose outcome may still be reported


class RegistrationConflictError(ValueError):
    """An instance disagrees with its model's other instances (block size, KV format or dtype)."""


class BlockSizeMismatchError(ValueError):
    """A placement asked with block keys of another block size than the model's instances use."""


@dataclass(frozen=True, slots=True)
class BlockUpdate:
    stored: bool            # False: removed
    key: BlockKey
    tier: Tier


@dataclass(slots=True)
class _Placed:
    prefill: InstanceId
    decode: InstanceId
    predicted_ttft_s: float | None  # None once reported
    model_id: str = ""
    max_tokens: int = 0


# What must agree across a model's prefill and decode instances ("" / 0: not stated, not checked).
# context_window: every engine serves the window its model's config states (hf_config), so a
# request the gateway admitted fits wherever it is placed.
_AGREED = ("block_size", "kv_format", "kv_dtype", "context_window")


class Conductor:
    def __init__(self, settings: SchedulerSettings, clock: Callable[[], float] = time.monotonic,
                 costs: CostModels | None = None) -> None:
        self.settings = settings
        self.costs = costs or cost_models_from_settings(settings.cost)
        self._clock = clock
        self.registry = InstanceRegistry(settings.heartbeat_timeout_s, clock)
        self.index = PrefixIndex(settings.index.max_blocks)
        p = settings.policy
        self.policy = make_policy(
            p.name,
            self.costs,
            Slo(settings.slo.ttft_s, settings.slo.tbt_s, settings.slo.reject_early, settings.slo.decode_wait_in_tbt),
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
        self._placed: OrderedDict[str, _Placed] = OrderedDict()
        self._anonymous = itertools.count()
        # How long decode requests really run, so when their KV frees (output_lengths.py).
        lengths = settings.output_lengths
        self.output_lengths = OutputLengths(lengths.window, lengths.min_samples, lengths.quantile)

    # ---- instances -------------------------------------------------------------------------

    def register(self, spec: InstanceSpec, assumed: bool = False) -> bool:
        """Add or replace an instance; returns whether it should send a block snapshot.

        A (re-)registering instance may have restarted with an empty cache, so whatever the
        index held for it is dropped rather than trusted. Raises ``RegistrationConflictError``
        when it disagrees with the model's other instances. ``assumed``: discovered, with
        guessed details, which nothing is checked against until the instance registers itself.
        """
        if not assumed:
            self._check_agreement(spec)
        self.registry.register(spec, assumed)
        self.index.drop_source(spec.instance_id)
        self._snapshotted.discard(SourceId(spec.instance_id))
        return True

    def _check_agreement(self, spec: InstanceSpec) -> None:
        if spec.role is Role.KVSTORE:  # model-agnostic: holds whatever engines store
            return
        pinned = self.settings.block_size
        if pinned and spec.block_size != pinned:
            raise RegistrationConflictError(
                f"instance {spec.instance_id} has block_size {spec.block_size}, but the scheduler's "
                f"block_size setting is {pinned}"
            )
        for other in self._model_records(spec.model_id):
            if other.spec.instance_id == spec.instance_id:
                continue
            problems = [
                f"{name} {getattr(spec, name)!r} differs from {getattr(other.spec, name)!r}"
                for name in _AGREED
                if getattr(spec, name) and getattr(other.spec, name) and getattr(spec, name) != getattr(other.spec, name)
            ]
            if problems:
                raise RegistrationConflictError(
                    f"instance {spec.instance_id} of model {spec.model_id!r}: {'; '.join(problems)} "
                    f"of registered instance {other.spec.instance_id}"
                )
            return  # the registered ones agree with each other: one comparison is enough

    def _model_records(self, model_id: str) -> list[InstanceRecord]:
        """The model's live engines that registered themselves (their details are facts)."""
        return [r for role in (Role.PREFILL, Role.DECODE) for r in self.registry.live(role)
                if r.spec.model_id == model_id and not r.assumed]

    def model_block_size(self, model_id: str) -> int:
        """The block size of the model's instances (the pinned one if set); 0 while unknown."""
        if self.settings.block_size:
            return self.settings.block_size
        return next((r.spec.block_size for r in self._model_records(model_id) if r.spec.block_size), 0)

    def heartbeat(self, instance_id: InstanceId, load: LoadReport) -> bool:
        """Record a load report; False when the instance must register again."""
        try:
            self.registry.heartbeat(instance_id, load)
        except KeyError:
            return False
        return True

    def deregister(self, instance_id: InstanceId) -> bool:
        """Drop an instance known to be gone (draining, or its endpoint left), with its index entries."""
        removed = self.registry.remove(instance_id)
        self.index.drop_source(instance_id)
        self._snapshotted.discard(SourceId(instance_id))
        return removed

    def report_unreachable(self, instance_ids: Iterable[str]) -> list[InstanceId]:
        """A caller could not reach these instances: no placement goes there until they heartbeat
        or register again (``InstanceRegistry.mark_unreachable``). Returns those this report took out."""
        return [InstanceId(i) for i in dict.fromkeys(instance_ids) if self.registry.mark_unreachable(InstanceId(i))]

    def expire(self) -> list[InstanceId]:
        """Drop silent instances (returned) and reservations no report covered in time."""
        dead = self.registry.expire()
        for instance_id in dead:
            self.index.drop_source(instance_id)
            self._snapshotted.discard(SourceId(instance_id))
        expired = self.registry.expire_reservations(self.settings.reservation_timeout_s)
        if expired:
            log.warning("%d reservations expired without a load report covering them", expired)
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

    def view(self, model_id: str = "", need_kv_tokens: int = 0, sequences: int = 1) -> ClusterView:
        """The cluster as the policy sees it: reported load plus what reports do not cover yet."""
        now = self._clock()
        prefill, decode = [], []
        for r in self.registry.placeable(Role.PREFILL):
            if model_id and r.spec.model_id != model_id:
                continue
            queued_requests, _, running = r.load.prefill_queue(r.spec.role)
            queued = queued_requests + running + sum(1 for _ in r.prefill_reservations.pending())
            cost = self._prefill_cost(r)
            prefill.append(PrefillCandidate(r.spec.instance_id, self._prefill_queue_s(r, cost), queued, r.spec.address,
                                            None if cost is self.costs.prefill else cost))
        for r in self.registry.placeable(Role.DECODE):
            if model_id and r.spec.model_id != model_id:
                continue
            decode.append(self._decode_candidate(r, need_kv_tokens, sequences, now))
        registered = {SourceId(r.spec.instance_id) for r in self.registry.all()}
        kvstores = {SourceId(r.spec.instance_id) for r in self.registry.live(Role.KVSTORE)}
        # Unregistered sources publishing events are older kvstore nodes: shared too.
        shared = frozenset(kvstores | {s for s in self.index.sources() if s not in registered})
        return ClusterView(prefill, decode, self.index, shared)

    def _prefill_cost(self, r: InstanceRecord) -> PrefillCostModel | MixedPrefillCost:
        """The prefill model, or for an aggregated instance (when ``cost.mixed`` is fitted) its
        mixed steps with the sequences it decodes now."""
        if r.spec.role is not Role.AGGREGATED or self.costs.mixed is None:
            return self.costs.prefill
        return MixedPrefillCost(self.costs.mixed, self.settings.aggregated_chunk_tokens,
                                r.load.running_requests, r.load.queued_tokens)

    def _prefill_queue_s(self, r: InstanceRecord, cost: PrefillCostModel | MixedPrefillCost) -> float:
        """Predicted wait before a new prompt starts on a prefill instance.

        Requests this scheduler placed count one by one with their own prompt and cached
        prefix; the report says how far the instance got (tokens left) and covers requests the
        scheduler does not know (placed before it restarted) as equal shares of the rest.
        """
        book = r.prefill_reservations
        held = book.held_in_order()
        pending = sum(cost.seconds(e.tokens, e.prompt_tokens - e.tokens) for e in book.pending())
        queued, queued_tokens, running = r.load.prefill_queue(r.spec.role)
        reported_requests = queued + running
        reported_tokens = queued_tokens or reported_requests * self.settings.assumed_prompt_tokens
        held_tokens = sum(e.tokens for e in held)
        queue_s = pending
        for i, e in enumerate(held):
            seconds = cost.seconds(e.tokens, e.prompt_tokens - e.tokens)
            if i == 0 and e.tokens and held_tokens > reported_tokens:  # the running one is partly done
                seconds *= max(e.tokens - (held_tokens - reported_tokens), 0) / e.tokens
            queue_s += seconds
        unknown = reported_requests - len(held)
        unknown_tokens = reported_tokens - held_tokens
        if unknown > 0 and unknown_tokens > 0:  # unknown prompts: equal shares of the tokens left
            queue_s += unknown * cost.seconds(unknown_tokens // unknown)
        return queue_s

    def _decode_candidate(self, r: InstanceRecord, need_kv_tokens: int, sequences: int, now: float) -> DecodeCandidate:
        spec, load = r.spec, r.load
        pending, pending_kv, pending_prompt = r.reservations.pending_totals()
        freed, freed_kv = r.reservations.freed_totals()  # ended since the report: free already
        batch = max(load.running_requests + load.queued_requests - freed, 0) + pending
        context = load.queued_tokens + pending_prompt
        capacity = spec.kv_capacity_tokens if spec.kv_capacity_tokens > 0 else None
        free = min(load.free_kv_tokens + freed_kv, capacity) - pending_kv if capacity is not None else None
        slot_short = bool(spec.max_batch_size) and batch + sequences > spec.max_batch_size
        releases: tuple[tuple[float, int], ...] = ()
        if capacity is not None and (slot_short or (free is not None and free < need_kv_tokens)):
            running = min(batch, spec.max_batch_size) if spec.max_batch_size else batch
            step = self.costs.decode.step_seconds(max(running, 1), context)
            releases = tuple(self._project_releases(r, step, now))  # only when the policy needs them
        return DecodeCandidate(spec.instance_id, batch, context, free, spec.max_batch_size, spec.address,
                               capacity, releases)

    def _project_releases(self, r: InstanceRecord, step_s: float, now: float) -> list[tuple[float, int]]:
        """When each request held by or promised to a decode instance frees its KV: after the
        steps it is expected to run (``output_lengths``: calibrated from the requests that
        finished, ``max_tokens`` until enough did), less those it already ran."""
        model = r.spec.model_id
        held = r.reservations.held_in_order()
        # What requests unknown to us leave (those that ended since the report are free already).
        room = r.load.free_kv_tokens + r.reservations.freed_totals()[1] + sum(e.tokens for e in held)
        known = []
        for e in held:  # one still waiting at the instance makes no progress
            done = (now - e.running_since) / step_s if e.running_since is not None and step_s > 0 else 0.0
            # Past its expected length it is near its end: a step left, never more than max_tokens allows.
            left = min(max(self.output_lengths.expected_steps(model, e.max_tokens) - done, 1.0), e.max_tokens - done)
            known.append(KnownRequest(e.tokens, left, 0.0, e.sequences))
        pending = sorted(r.reservations.pending(), key=lambda e: e.placed_at + e.ready_in_s)
        known += [KnownRequest(e.tokens, self.output_lengths.expected_steps(model, e.max_tokens),
                               max(e.ready_in_s - (now - e.placed_at), 0.0), e.sequences)
                  for e in pending]
        return project_releases(known, room, r.spec.max_batch_size, step_s)

    def place(self, request_id: str, model_id: str, block_keys: tuple[BlockKey, ...],
              prompt_tokens: int, max_tokens: int, block_size: int = 0, n: int = 1,
              unreachable: Iterable[str] = ()) -> Decision:
        """Place one request, or reject it with its true reason. ``block_size``: the one the
        caller computed ``block_keys`` with (0: not stated); another than the model's raises
        ``BlockSizeMismatchError``. ``n``: choices decoded from the prompt, placed together.
        ``unreachable``: instances the caller just failed to reach (``report_unreachable``)."""
        self.report_unreachable(unreachable)
        model_block = self.model_block_size(model_id)
        if block_size and model_block and block_size != model_block:
            raise BlockSizeMismatchError(
                f"block keys computed with block_size {block_size}, but the instances of model {model_id!r} "
                f"use block_size {model_block}"
            )
        request_id = request_id or f"anonymous-{next(self._anonymous)}"
        self.release(request_id)  # placed again (a retry, a migration): the earlier promise is void
        assumed = next((r.spec.block_size for r in self.registry.live(Role.PREFILL) if r.spec.model_id == model_id), 1)
        request = PlacementRequest(request_id, block_keys, prompt_tokens, max_tokens,
                                   model_block or block_size or assumed, n)
        view = self.view(model_id, request.decode_kv_tokens, request.sequences)
        decision = self.policy.place(request, view)
        if isinstance(decision, Rejection) and decision.reason.startswith("no_") and model_id:
            decision = Rejection(decision.reason, f"{decision.message} for model {model_id!r}", decision.retry_after_s)
        if isinstance(decision, Rejection) and decision.reason == "decode_kv_full":
            decision = Rejection(decision.reason, f"{decision.message} ({self._kv_wait_basis(model_id)})",
                                 decision.retry_after_s)
        if isinstance(decision, Placement):
            self._reserve(request, decision)
        return decision

    def _kv_wait_basis(self, model_id: str) -> str:
        """What a predicted decode KV wait assumed about how long requests run, for its refusal."""
        lengths = self.output_lengths
        seen = lengths.samples(model_id)
        length = lengths.length(model_id)
        if math.isinf(length):
            return (f"each request there is expected to run its whole max_tokens: {seen} of this model's requests "
                    f"finished so far, too few stopping on their own to tell how long they run")
        return (f"each request there is expected to run at most {length:.0f} tokens, the "
                f"{round(lengths.quantile * 100)}th percentile of the last {seen} of this model's requests that finished")

    def _reserve(self, request: PlacementRequest, decision: Placement) -> None:
        now = self._clock()
        prompt, max_tokens = request.prompt_tokens, request.max_tokens
        cached = min(decision.cached_blocks * request.block_size, prompt)
        prefill = self.registry.get(decision.prefill)
        decode = self.registry.get(decision.decode)
        assert prefill is not None and decode is not None  # the view came from the registry just now
        prefill.prefill_reservations.add(Reservation(request.request_id, prompt - cached, prompt, max_tokens, now, 0.0))
        decode.reservations.add(
            Reservation(request.request_id, request.decode_kv_tokens, prompt, max_tokens, now, decision.predicted_ttft_s,
                        sequences=request.sequences)
        )
        self._placed[request.request_id] = _Placed(decision.prefill, decision.decode, decision.predicted_ttft_s,
                                                   decode.spec.model_id, max_tokens)
        if len(self._placed) > _REMEMBERED_PLACEMENTS:
            self._placed.popitem(last=False)

    def release(self, request_id: str) -> None:
        """Forget every reservation of ``request_id`` (it will not reach its instances)."""
        placed = self._placed.pop(request_id, None)
        if placed is not None:
            for instance_id in (placed.prefill, placed.decode):
                record = self.registry.get(instance_id)
                if record is not None:
                    for book in record.books():
                        book.release(request_id)

    def outcome(self, request_id: str, ttft_s: float, released: bool, *, finished: bool = False,
                output_tokens: int = 0) -> float | None:
        """The gateway's report on a placed request; returns its predicted TTFT, once.

        A first token means prefill's work is done; ``released``: the request will not reach
        decode (ended at its first token, failed, cancelled), so its KV promise there ends too.
        ``finished``: it ended at decode after ``output_tokens`` (calibrates ``output_lengths``);
        its promises end too.
        """
        placed = self._placed.get(request_id)
        if placed is None:
            return None
        if finished:
            self.output_lengths.observe(placed.model_id, output_tokens, placed.max_tokens)
            self.release(request_id)
            return None
        predicted, placed.predicted_ttft_s = placed.predicted_ttft_s, None
        if ttft_s > 0:
            record = self.registry.get(placed.prefill)
            if record is not None:
                record.prefill_reservations.release(request_id)
        if released:
            self.release(request_id)
        return predicted
