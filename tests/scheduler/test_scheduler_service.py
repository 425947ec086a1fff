"""The scheduler as a real process, driven through gRPC the way instances and the gateway do."""

from __future__ import annotations

import time

import grpc
import pytest

from crescent.protos import common_pb2, scheduler_pb2
from crescent.services.contract.block_keys import prefix_block_keys

from .support import instance

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def keys(n: int, tag: int = 0) -> list[bytes]:
    return prefix_block_keys(list(range(tag * 1000, tag * 1000 + 4 * n)), 4, "m")


def place(stub, block_keys=(), prompt_tokens=64, max_tokens=16, model_id="m", request_id="r", block_size=0):
    return stub.Place(scheduler_pb2.PlaceRequest(
        request_id=request_id, model_id=model_id, block_keys=list(block_keys), prompt_tokens=prompt_tokens,
        max_tokens=max_tokens, block_size=block_size,
    ))


def stored(source: str, block_keys, tier=common_pb2.KV_TIER_ENGINE, full=False) -> common_pb2.BlockEventBatch:
    return common_pb2.BlockEventBatch(
        source_id=source, full_snapshot=full,
        events=[common_pb2.BlockEvent(kind=common_pb2.BLOCK_EVENT_STORED, key=k, tier=tier, num_tokens=4) for k in block_keys],
    )


def test_places_a_registered_pair_and_lists_them(start_scheduler) -> None:
    sched = start_scheduler(heartbeat_interval_s=0.5, heartbeat_timeout_s=5)
    reply = sched.stub.Register(instance("p0", "prefill"))
    assert reply.heartbeat_interval_ms == 500
    sched.stub.Register(instance("d0", "decode"))
    placement = place(sched.stub)
    assert not placement.HasField("rejection")
    assert (placement.prefill.instance_id, placement.prefill.address) == ("p0", "p0.local:7000")
    assert (placement.decode.instance_id, placement.decode.address) == ("d0", "d0.local:7000")
    assert placement.predicted_ttft_s > 0
    listed = {s.info.instance_id: s for s in sched.stub.ListInstances(scheduler_pb2.ListInstancesRequest()).instances}
    assert set(listed) == {"p0", "d0"}
    assert listed["d0"].info.role == scheduler_pb2.INSTANCE_ROLE_DECODE


def test_rejects_when_a_role_has_no_instance(start_scheduler) -> None:
    sched = start_scheduler(no_instance_retry_after_s=3)
    empty = place(sched.stub)
    assert empty.rejection.reason == "no_prefill_instance"
    assert empty.rejection.retry_after_s == 3
    assert not empty.HasField("prefill")
    sched.stub.Register(instance("p0", "prefill"))
    assert place(sched.stub).rejection.reason == "no_decode_instance"
    sched.stub.Register(instance("d0", "decode", model_id="other"))
    only_other = place(sched.stub)
    assert only_other.rejection.reason == "no_decode_instance"
    assert "'m'" in only_other.rejection.message
    metrics = sched.metrics()
    assert 'crescent_scheduler_rejections_total{reason="no_prefill_instance"} 1.0' in metrics
    assert 'crescent_scheduler_rejections_total{reason="no_decode_instance"} 2.0' in metrics


def test_bad_registration_is_invalid_argument(start_scheduler) -> None:
    sched = start_scheduler()
    with pytest.raises(grpc.RpcError) as err:
        sched.stub.Register(scheduler_pb2.InstanceInfo(instance_id="x", address="a:1", block_size=4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "role" in err.value.details()


def test_longest_cached_prefix_wins_ties_go_to_least_loaded(start_scheduler) -> None:
    sched = start_scheduler(policy={"name": "cache_aware"}, heartbeat_timeout_s=30)
    for name in ("p0", "p1", "p2"):
        sched.stub.Register(instance(name, "prefill"))
    sched.stub.Register(instance("d0", "decode"))
    prompt = keys(40)
    sched.stub.PublishBlockEvents(stored("p1", prompt[:10]))
    sched.stub.PublishBlockEvents(stored("p2", prompt[:30]))
    # p2 has a little queue; its 20 extra cached blocks still save more than the wait costs.
    sched.stub.Heartbeat(scheduler_pb2.InstanceLoad(instance_id="p2", queued_requests=1, queued_tokens=8))
    hit = place(sched.stub, prompt, prompt_tokens=4 * 40 + 3)
    assert hit.prefill.instance_id == "p2"
    assert hit.expected_cached_blocks == 30
    # A prompt nobody holds: equal prefixes (none), so the least loaded instance wins.
    sched.stub.Heartbeat(scheduler_pb2.InstanceLoad(instance_id="p0", queued_requests=3, queued_tokens=900))
    cold = place(sched.stub, keys(40, tag=7), prompt_tokens=163)
    assert cold.prefill.instance_id == "p1"
    assert cold.expected_cached_blocks == 0


def test_kvstore_blocks_count_for_every_prefill_instance(start_scheduler) -> None:
    sched = start_scheduler(heartbeat_timeout_s=30)
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode"))
    prompt = keys(12)
    reply = sched.stub.PublishBlockEvents(stored("kvstore-a", prompt[:8], tier=common_pb2.KV_TIER_HOST))
    assert reply.accepted == 8
    placement = place(sched.stub, prompt, prompt_tokens=50)
    assert placement.expected_cached_blocks == 8
    assert placement.prefix_source_id == "kvstore-a"
    removed = common_pb2.BlockEventBatch(source_id="kvstore-a", events=[
        common_pb2.BlockEvent(kind=common_pb2.BLOCK_EVENT_REMOVED, key=k) for k in prompt[4:8]])
    sched.stub.PublishBlockEvents(removed)
    assert place(sched.stub, prompt, prompt_tokens=50).expected_cached_blocks == 4


def test_silent_instances_are_dropped(start_scheduler) -> None:
    sched = start_scheduler(heartbeat_interval_s=0.2, heartbeat_timeout_s=0.8)
    for name in ("p0", "p1"):
        sched.stub.Register(instance(name, "prefill"))
    sched.stub.Register(instance("d0", "decode"))
    sched.stub.PublishBlockEvents(stored("p0", keys(5)))
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # p1 and d0 keep heartbeating, p0 falls silent
        for name in ("p1", "d0"):
            load = scheduler_pb2.InstanceLoad(instance_id=name, free_kv_tokens=100_000)
            assert sched.stub.Heartbeat(load).known
        time.sleep(0.1)
    listed = {s.info.instance_id for s in sched.stub.ListInstances(scheduler_pb2.ListInstancesRequest()).instances}
    assert listed == {"p1", "d0"}
    for i in range(5):  # even with p0's prefix in the prompt, nothing goes to it
        assert place(sched.stub, keys(5), prompt_tokens=24, request_id=f"r{i}").prefill.instance_id == "p1"
    assert not sched.stub.Heartbeat(scheduler_pb2.InstanceLoad(instance_id="p0")).known


@pytest.mark.slow
def test_after_restart_instances_reregister_and_sources_resend_snapshots(start_scheduler) -> None:
    sched = start_scheduler(heartbeat_timeout_s=30)
    sched.stub.Register(instance("p0", "prefill"))
    assert sched.stub.Heartbeat(scheduler_pb2.InstanceLoad(instance_id="p0")).known
    assert sched.stub.PublishBlockEvents(stored("kv0", keys(3), full=True)).want_full_snapshot is False
    sched.stop()
    sched.start()  # same port, empty state
    assert not sched.stub.Heartbeat(scheduler_pb2.InstanceLoad(instance_id="p0")).known
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode"))
    # An incremental event after the restart: accepted, but the source is asked for a snapshot.
    assert sched.stub.PublishBlockEvents(stored("kv0", keys(3)[2:])).want_full_snapshot is True
    # Meanwhile the index knows only block 2 of the prefix: no hit is claimed for it.
    assert place(sched.stub, keys(3), prompt_tokens=14).expected_cached_blocks == 0
    assert sched.stub.PublishBlockEvents(stored("kv0", keys(3), full=True)).want_full_snapshot is False
    assert place(sched.stub, keys(3), prompt_tokens=14).expected_cached_blocks == 3


def test_ttft_slo_rejection_and_metrics(start_scheduler) -> None:
    sched = start_scheduler(slo={"ttft_s": 5.0}, heartbeat_timeout_s=30)
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode"))
    ok = place(sched.stub, prompt_tokens=100, request_id="fine")
    assert not ok.HasField("rejection")
    sched.stub.Heartbeat(scheduler_pb2.InstanceLoad(instance_id="p0", queued_requests=4, queued_tokens=8000))
    late = place(sched.stub, prompt_tokens=100, request_id="late")
    assert late.rejection.reason == "ttft_slo"
    assert late.rejection.retry_after_s >= 1
    assert "SLO" in late.rejection.message
    sched.stub.ReportOutcome(scheduler_pb2.RequestOutcome(request_id="fine", ttft_s=0.5))
    metrics = sched.metrics()
    assert 'crescent_scheduler_placements_total{decode="d0",prefill="p0"} 1.0' in metrics
    assert 'crescent_scheduler_rejections_total{reason="ttft_slo"} 1.0' in metrics
    assert "crescent_scheduler_observed_ttft_seconds_count 1.0" in metrics
    assert "crescent_scheduler_ttft_prediction_error_seconds_count 1.0" in metrics
    assert "crescent_scheduler_decision_seconds_count 2.0" in metrics


def test_reregistered_instance_loses_its_stale_blocks(start_scheduler) -> None:
    sched = start_scheduler(heartbeat_timeout_s=30)
    assert sched.stub.Register(instance("p0", "prefill")).want_full_snapshot
    sched.stub.Register(instance("d0", "decode"))
    prompt = keys(6)
    sched.stub.PublishBlockEvents(stored("p0", prompt, full=True))
    assert place(sched.stub, prompt, prompt_tokens=30).expected_cached_blocks == 6
    # p0 restarted with an empty cache: what the index held for it must not be trusted.
    assert sched.stub.Register(instance("p0", "prefill")).want_full_snapshot
    assert place(sched.stub, prompt, prompt_tokens=30).expected_cached_blocks == 0


def test_disagreeing_instances_and_block_sizes_are_refused_loudly(start_scheduler) -> None:
    sched = start_scheduler(heartbeat_timeout_s=30)
    sched.stub.Register(instance("p0", "prefill", kv_format="paged-v1:30x2x64", kv_dtype="float32"))
    with pytest.raises(grpc.RpcError) as err:
        sched.stub.Register(instance("d0", "decode", kv_format="paged-v1:30x2x64", kv_dtype="bfloat16"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'bfloat16'" in err.value.details() and "'float32'" in err.value.details()
    sched.stub.Register(instance("d0", "decode", kv_format="paged-v1:30x2x64", kv_dtype="float32"))
    # A kvstore node holds blocks of any model: no block size, no format to agree on.
    sched.stub.Register(instance("kv0", "kvstore", model_id="", block_size=0))
    with pytest.raises(grpc.RpcError) as err:
        place(sched.stub, keys(4), prompt_tokens=20, block_size=8)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size 8" in err.value.details() and "block_size 4" in err.value.details()
    assert not place(sched.stub, keys(4), prompt_tokens=20, block_size=4).HasField("rejection")
    roles = {s.info.instance_id: s.info.role for s in sched.stub.ListInstances(scheduler_pb2.ListInstancesRequest()).instances}
    assert roles["kv0"] == scheduler_pb2.INSTANCE_ROLE_KVSTORE


def test_a_registered_kvstore_is_named_but_never_dialled_as_a_peer(start_scheduler) -> None:
    sched = start_scheduler(heartbeat_timeout_s=30)
    for name, role in (("p0", "prefill"), ("d0", "decode")):
        sched.stub.Register(instance(name, role))
    sched.stub.Register(instance("kv0", "kvstore", model_id="", block_size=0))
    prompt = keys(10)
    sched.stub.PublishBlockEvents(stored("kv0", prompt[:9], tier=common_pb2.KV_TIER_HOST, full=True))
    placement = place(sched.stub, prompt, prompt_tokens=43)
    # Prefill reads kvstore blocks through its own node; only peer engines get an address to pull from.
    assert (placement.prefix_source_id, placement.prefix_source_address) == ("kv0", "")
    assert placement.expected_cached_blocks == 9


def test_released_and_reported_requests_free_what_was_reserved(start_scheduler) -> None:
    sched = start_scheduler(heartbeat_timeout_s=30, slo={"ttft_s": 5.0})
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode", kv_capacity_tokens=1000))
    assert not place(sched.stub, prompt_tokens=500, max_tokens=400, request_id="a").HasField("rejection")
    # a's 900 tokens are promised: b does not fit, and a frees them only after its 400 tokens.
    full = place(sched.stub, prompt_tokens=500, max_tokens=400, request_id="b")
    assert full.rejection.reason == "decode_kv_full" and full.rejection.retry_after_s >= 1
    # a ended at its first token (the gateway says so): its decode KV is free again.
    sched.stub.ReportOutcome(scheduler_pb2.RequestOutcome(request_id="a", ttft_s=0.3, released=True))
    assert not place(sched.stub, prompt_tokens=500, max_tokens=400, request_id="b").HasField("rejection")
    # b reached decode and finished: the instance's report retires it.
    sched.stub.Heartbeat(scheduler_pb2.InstanceLoad(instance_id="d0", free_kv_tokens=100, running_requests=1,
                                                    active_request_ids=["b"]))
    assert place(sched.stub, prompt_tokens=500, max_tokens=400, request_id="c").rejection.reason == "decode_kv_full"
    sched.stub.Heartbeat(scheduler_pb2.InstanceLoad(instance_id="d0", free_kv_tokens=1000, finished_request_ids=["b"]))
    assert not place(sched.stub, prompt_tokens=500, max_tokens=400, request_id="c").HasField("rejection")
    # A draining instance takes nothing new.
    sched.stub.Heartbeat(scheduler_pb2.InstanceLoad(instance_id="d0", free_kv_tokens=1000, draining=True))
    assert place(sched.stub, prompt_tokens=10, max_tokens=4, request_id="d").rejection.reason == "no_decode_instance"
