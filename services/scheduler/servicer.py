"""gRPC servicer of the scheduler: converts protobuf to the Conductor's types and back."""

from __future__ import annotations

import logging
import time
from functools import cache

import grpc
from prometheus_client import Counter, Gauge

from crescent.protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from crescent.services.contract.block_keys import BlockKey
from crescent.services.contract.choices import MAX_CHOICES
from crescent.services.common.logs import request_id_var
from crescent.services.common.metrics import scheduler_metrics
from crescent.services.scheduler.conductor import (
    BlockSizeMismatchError,
    BlockUpdate,
    Conductor,
    RegistrationConflictError,
)
from crescent.services.scheduler.datatypes import InstanceId, Placement, Role, Tier
from crescent.services.scheduler.registry import InstanceSpec, LoadReport

log = logging.getLogger(__name__)

_ROLES = {
    scheduler_pb2.INSTANCE_ROLE_PREFILL: Role.PREFILL,
    scheduler_pb2.INSTANCE_ROLE_DECODE: Role.DECODE,
    scheduler_pb2.INSTANCE_ROLE_KVSTORE: Role.KVSTORE,
    scheduler_pb2.INSTANCE_ROLE_AGGREGATED: Role.AGGREGATED,
}
_ROLE_PB = {v: k for k, v in _ROLES.items()}
_STORED = {common_pb2.BLOCK_EVENT_STORED, common_pb2.BLOCK_EVENT_TIER_CHANGED}


@cache
def unreachable_counter() -> Counter:
    # Kept with the scheduler's code rather than in services/common/metrics.py (shared by all services).
    return Counter("crescent_scheduler_unreachable_reports", "Instances taken out of placement because a caller "
                   "reported them unreachable (until their next heartbeat)", ["role"])


@cache
def output_length_gauge() -> Gauge:
    return Gauge("crescent_scheduler_expected_output_tokens", "Natural output length (90th percentile) decode "
                 "requests are expected to run at most, from the finished ones (+Inf: not known yet, max_tokens "
                 "is used)", ["model"])


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor
        self.metrics = scheduler_metrics()
        for role in (Role.PREFILL, Role.DECODE, Role.AGGREGATED):
            unreachable_counter().labels(role.value)  # exported as 0 from the start

    async def Register(self, request: scheduler_pb2.InstanceInfo, context: grpc.aio.ServicerContext) -> scheduler_pb2.RegisterReply:
        role = _ROLES.get(request.role)
        problems = []
        if not request.instance_id:
            problems.append("instance_id is empty")
        if role is None:
            problems.append("role must be INSTANCE_ROLE_PREFILL, INSTANCE_ROLE_DECODE, INSTANCE_ROLE_AGGREGATED "
                            "or INSTANCE_ROLE_KVSTORE")
        if not request.address:
            problems.append("address is empty")
        if request.block_size < 0 or (request.block_size == 0 and role is not Role.KVSTORE):
            problems.append("block_size must be positive")
        if problems:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))
        assert role is not None
        spec = InstanceSpec(
            instance_id=InstanceId(request.instance_id),
            role=role,
            address=request.address,
            model_id=request.model_id,
            block_size=request.block_size,
            kv_capacity_tokens=request.kv_capacity_tokens,
            max_batch_size=request.max_batch_size,
            kv_format=request.kv_format,
            kv_dtype=request.kv_dtype,
            context_window=request.context_window,
        )
        try:
            want_snapshot = self.conductor.register(spec)
        except RegistrationConflictError as exc:
            log.error("refused to register %s: %s", request.instance_id, exc)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self._count_instances()
        interval_ms = round(self.conductor.settings.heartbeat_interval_s * 1000)
        return scheduler_pb2.RegisterReply(heartbeat_interval_ms=interval_ms, want_full_snapshot=want_snapshot)

    async def Heartbeat(self, request: scheduler_pb2.InstanceLoad, context: grpc.aio.ServicerContext) -> scheduler_pb2.HeartbeatReply:
        load = LoadReport(
            queued_requests=max(request.queued_requests, 0),
            queued_tokens=max(request.queued_tokens, 0),
            running_requests=max(request.running_requests, 0),
            free_kv_tokens=max(request.free_kv_tokens, 0),
            active_request_ids=tuple(request.active_request_ids),
            finished_request_ids=tuple(request.finished_request_ids),
            draining=request.draining,
            prefill_queued_requests=max(request.prefill_queued_requests, 0),
            prefill_queued_tokens=max(request.prefill_queued_tokens, 0),
            prefill_running_requests=max(request.prefill_running_requests, 0),
        )
        return scheduler_pb2.HeartbeatReply(known=self.conductor.heartbeat(InstanceId(request.instance_id), load))

    async def Place(self, request: scheduler_pb2.PlaceRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.Placement:
        token = request_id_var.set(request.request_id or "-")
        try:
            if request.prompt_tokens <= 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_tokens must be positive")
            if not 0 <= request.n <= MAX_CHOICES:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"n must be between 0 and {MAX_CHOICES} (0 or 1: one choice)")
            start = time.perf_counter()
            self._report_unreachable(request.unreachable_instance_ids)
            try:
                decision = self.conductor.place(
                    request.request_id,
                    request.model_id,
                    tuple(BlockKey(k) for k in request.block_keys),
                    request.prompt_tokens,
                    max(request.max_tokens, 1),
                    max(request.block_size, 0),
                    max(request.n, 1),
                )
            except BlockSizeMismatchError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            self.metrics.decision_seconds.observe(time.perf_counter() - start)
            if not isinstance(decision, Placement):
                self.metrics.rejections.labels(decision.reason).inc()
                log.info("rejected: %s (%s)", decision.reason, decision.message)
                return scheduler_pb2.Placement(
                    rejection=scheduler_pb2.Rejection(
                        reason=decision.reason, message=decision.message, retry_after_s=decision.retry_after_s
                    )
                )
            return self._placement_pb(decision)
        finally:
            request_id_var.reset(token)

    def _report_unreachable(self, instance_ids: list[str]) -> None:
        """The caller could not reach these instances just now: out of placement until they heartbeat."""
        for instance_id in self.conductor.report_unreachable(instance_ids):
            record = self.conductor.registry.get(instance_id)
            unreachable_counter().labels(record.spec.role.value if record else "unknown").inc()

    def _placement_pb(self, decision: Placement) -> scheduler_pb2.Placement:
        self.metrics.placements.labels(decision.prefill, decision.decode).inc()
        self.metrics.predicted_ttft.observe(decision.predicted_ttft_s)
        reply = scheduler_pb2.Placement(
            prefill=self._ref(decision.prefill),
            decode=self._ref(decision.decode),
            expected_cached_blocks=decision.cached_blocks,
            predicted_ttft_s=decision.predicted_ttft_s,
            predicted_tbt_s=decision.predicted_tbt_s,
        )
        if decision.pull is not None:
            self.metrics.prefix_pulls.inc()
            reply.prefix_source_id = decision.pull.source
            reply.prefix_source_blocks = decision.pull.blocks
            source = self.conductor.registry.get(InstanceId(decision.pull.source))
            # Only a peer engine is dialled: prefill reads a kvstore source through its own node's
            # kvstore (which asks its peers), and a kvstore serves no FetchPrefix.
            if source is not None and source.spec.role is not Role.KVSTORE:
                reply.prefix_source_address = source.spec.address
        return reply

    def _ref(self, instance_id: InstanceId) -> scheduler_pb2.InstanceRef:
        record = self.conductor.registry.get(instance_id)
        return scheduler_pb2.InstanceRef(instance_id=instance_id, address=record.spec.address if record else "")

    async def PublishBlockEvents(self, request: common_pb2.BlockEventBatch, context: grpc.aio.ServicerContext) -> scheduler_pb2.EventsReply:
        if not request.source_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "source_id is empty")
        updates = []
        for event in request.events:
            if event.kind == common_pb2.BLOCK_EVENT_UNSPECIFIED or not event.key:
                continue
            tier = Tier(event.tier) if event.tier in Tier._value2member_map_ else Tier.ENGINE
            updates.append(BlockUpdate(event.kind in _STORED, BlockKey(event.key), tier))
        accepted, want_snapshot = self.conductor.publish(request.source_id, updates, request.full_snapshot)
        self.metrics.indexed_blocks.set(len(self.conductor.index))
        return scheduler_pb2.EventsReply(accepted=accepted, want_full_snapshot=want_snapshot)

    async def ListInstances(self, request: scheduler_pb2.ListInstancesRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.ListInstancesReply:
        registry = self.conductor.registry
        reply = scheduler_pb2.ListInstancesReply()
        for r in registry.all():
            s, load = r.spec, r.load
            reply.instances.append(
                scheduler_pb2.InstanceStatus(
                    info=scheduler_pb2.InstanceInfo(
                        instance_id=s.instance_id, role=_ROLE_PB[s.role], address=s.address, model_id=s.model_id,
                        block_size=s.block_size, kv_capacity_tokens=s.kv_capacity_tokens, max_batch_size=s.max_batch_size,
                        kv_format=s.kv_format, kv_dtype=s.kv_dtype, context_window=s.context_window,
                    ),
                    load=scheduler_pb2.InstanceLoad(
                        instance_id=s.instance_id, queued_requests=load.queued_requests, queued_tokens=load.queued_tokens,
                        running_requests=load.running_requests, free_kv_tokens=load.free_kv_tokens,
                        active_request_ids=load.active_request_ids, draining=load.draining,
                    ),
                    last_heartbeat_age_s=registry.age_s(r),
                    indexed_blocks=self.conductor.index.blocks_of(s.instance_id),
                )
            )
        return reply

    async def ReportOutcome(self, request: scheduler_pb2.RequestOutcome, context: grpc.aio.ServicerContext) -> scheduler_pb2.OutcomeReply:
        predicted = self.conductor.outcome(request.request_id, max(request.ttft_s, 0.0), request.released,
                                           finished=request.finished, output_tokens=max(request.output_tokens, 0))
        if request.finished:
            lengths = self.conductor.output_lengths
            for model in lengths.models():
                output_length_gauge().labels(model or "-").set(lengths.length(model))
        if request.ttft_s > 0:
            self.metrics.observed_ttft.observe(request.ttft_s)
            if predicted is not None:
                self.metrics.ttft_error.observe(abs(request.ttft_s - predicted))
        return scheduler_pb2.OutcomeReply()

    async def Deregister(self, request: scheduler_pb2.DeregisterRequest, context: grpc.aio.ServicerContext) -> scheduler_pb2.DeregisterReply:
        if not request.instance_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "instance_id is empty")
        removed = self.conductor.deregister(InstanceId(request.instance_id))
        if removed:
            log.info("instance %s deregistered (draining)", request.instance_id)
        self._count_instances()
        return scheduler_pb2.DeregisterReply(removed=removed)

    def _count_instances(self) -> None:
        for role in Role:
            self.metrics.instances.labels(role.value).set(len(self.conductor.registry.live(role)))

    def refresh_gauges(self) -> None:
        self._count_instances()
        self.metrics.indexed_blocks.set(len(self.conductor.index))
