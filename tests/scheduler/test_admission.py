"""Admission that keeps its promises: reservations per request, queueing instead of false 429s,
true rejection reasons, draining instances and registration that refuses a disagreeing engine."""

from __future__ import annotations

import pytest

from crescent.services.contract.block_keys import BlockKey, prefix_block_keys
from crescent.services.scheduler.conductor import BlockSizeMismatchError, Conductor, RegistrationConflictError
from crescent.services.scheduler.config import SchedulerSettings
from crescent.services.scheduler.datatypes import InstanceId, Placement, Rejection, Role
from crescent.services.scheduler.registry import InstanceSpec, LoadReport


class Cluster:
    """A Conductor on a hand-driven clock with one prefill and some decode instances."""

    def __init__(self, decode: int = 1, kv_capacity: int = 4096, max_batch: int = 8, **settings: object) -> None:
        self.now = 0.0
        self.conductor = Conductor(SchedulerSettings(**settings), clock=lambda: self.now)
        self.register("p0", Role.PREFILL)
        for i in range(decode):
            self.register(f"d{i}", Role.DECODE, kv_capacity=kv_capacity, max_batch=max_batch)

    def register(self, name: str, role: Role, kv_capacity: int = 4096, max_batch: int = 8, block_size: int = 64,
                 kv_format: str = "paged-v1", kv_dtype: str = "float32", model: str = "m",
                 context_window: int = 8192) -> None:
        self.conductor.register(InstanceSpec(InstanceId(name), role, f"{name}:1", model, block_size,
                                             kv_capacity, max_batch, kv_format, kv_dtype, context_window))

    def place(self, rid: str, prompt: int = 100, max_tokens: int = 16, keys: tuple[BlockKey, ...] = ()):
        return self.conductor.place(rid, "m", keys, prompt, max_tokens)

    def beat(self, name: str, **load: object) -> None:
        assert self.conductor.heartbeat(InstanceId(name), LoadReport(**load))


def test_sequential_requests_ending_at_their_first_token_are_never_refused() -> None:
    # The measured bug: 300 sequential max_tokens=1 requests got 185 x 429 decode_kv_full.
    cluster = Cluster(kv_capacity=2048, max_batch=4)
    for i in range(300):
        rid = f"r{i}"
        decision = cluster.place(rid, prompt=300, max_tokens=1)
        assert isinstance(decision, Placement), (i, decision)
        cluster.now += 0.2
        # Prefill reports the request while it runs, then done; decode never sees it.
        cluster.beat("p0", running_requests=1, queued_tokens=300, active_request_ids=(rid,))
        cluster.conductor.outcome(rid, ttft_s=0.2, released=True)
        cluster.beat("p0", finished_request_ids=(rid,))
        cluster.beat("d0", free_kv_tokens=2048)


def test_requests_are_retired_by_the_decode_report_without_outcomes() -> None:
    cluster = Cluster(kv_capacity=1000, max_batch=4)
    assert isinstance(cluster.place("a", prompt=400, max_tokens=100), Placement)
    # Reported free KV does not include "a" yet: the reservation counts against it.
    assert cluster.conductor.view("m").decode[0].free_kv_tokens == 500
    cluster.beat("d0", running_requests=1, free_kv_tokens=500, active_request_ids=("a",))
    view = cluster.conductor.view("m").decode[0]
    assert (view.free_kv_tokens, view.batch_size) == (500, 1)  # counted once, inside the report
    cluster.beat("d0", free_kv_tokens=1000, finished_request_ids=("a",))
    assert cluster.conductor.view("m").decode[0].free_kv_tokens == 1000


def test_a_concurrent_burst_on_an_idle_cluster_queues_instead_of_429() -> None:
    # The measured bug: 24 concurrent requests got 8 x 429 because max_batch_size capped admission.
    cluster = Cluster(kv_capacity=32768, max_batch=8)
    decisions = [cluster.place(f"r{i}", prompt=120, max_tokens=64) for i in range(24)]
    assert all(isinstance(d, Placement) for d in decisions), [d for d in decisions if isinstance(d, Rejection)]
    # The ones beyond a full batch expect a wait for a slot: a longer predicted TBT.
    assert decisions[-1].predicted_tbt_s > decisions[0].predicted_tbt_s


def test_a_full_batch_is_a_wait_not_a_limit_until_the_wait_breaks_the_slo() -> None:
    cluster = Cluster(kv_capacity=100_000, max_batch=2, slo={"ttft_s": 20.0})
    decisions = [cluster.place(f"r{i}", prompt=50, max_tokens=200) for i in range(6)]
    placed = [d for d in decisions if isinstance(d, Placement)]
    assert len(placed) > 2  # more than a batch: the rest wait for a slot
    refused = [d for d in decisions if isinstance(d, Rejection)]
    # Each batch of two runs 200 steps (~14 s): the fifth would wait beyond the 20 s SLO.
    assert refused and all(d.reason == "decode_batch_full" and "batch slot" in d.message for d in refused)


def test_short_kv_queues_while_the_wait_meets_the_ttft_slo_then_rejects_with_the_true_reason() -> None:
    cluster = Cluster(kv_capacity=1200, max_batch=16, slo={"ttft_s": 8.0})
    assert isinstance(cluster.place("big", prompt=500, max_tokens=500), Placement)
    cluster.beat("d0", running_requests=1, free_kv_tokens=200, active_request_ids=("big",))
    # 600 more tokens do not fit now, but "big" frees 1000 within its 500 steps (~40 s at most).
    late = cluster.place("late", prompt=300, max_tokens=300)
    assert isinstance(late, Rejection) and late.reason == "decode_kv_full"
    assert "SLO" in late.message and late.retry_after_s >= 1
    # Near the end of "big", the same request queues: its KV frees before the SLO runs out.
    cluster.now += 35.0
    cluster.beat("p0")
    cluster.beat("d0", running_requests=1, free_kv_tokens=200, active_request_ids=("big",))
    queued = cluster.place("later", prompt=300, max_tokens=300)
    assert isinstance(queued, Placement), queued


def test_a_request_larger_than_every_decode_instance_is_refused_with_its_own_reason() -> None:
    cluster = Cluster(decode=2, kv_capacity=1024)
    decision = cluster.place("huge", prompt=900, max_tokens=500)
    assert isinstance(decision, Rejection) and decision.reason == "exceeds_kv_capacity"
    assert "1400" in decision.message and "1024" in decision.message


def test_reservations_expire_when_no_report_ever_covers_them() -> None:
    cluster = Cluster(kv_capacity=1000, reservation_timeout_s=120, heartbeat_timeout_s=500)
    assert isinstance(cluster.place("lost", prompt=500, max_tokens=400), Placement)
    cluster.beat("d0", free_kv_tokens=1000, active_request_ids=("other",))  # an instance that reports ids
    assert cluster.conductor.view("m").decode[0].free_kv_tokens == 100
    cluster.now += 121
    cluster.conductor.expire()
    assert cluster.conductor.view("m").decode[0].free_kv_tokens == 1000


def test_placing_a_request_again_voids_its_earlier_promise() -> None:
    cluster = Cluster(kv_capacity=1000)
    cluster.place("m1", prompt=500, max_tokens=400)
    cluster.place("m1", prompt=520, max_tokens=380)  # a migration: re-prefilled with what it generated
    assert cluster.conductor.view("m").decode[0].free_kv_tokens == 100


def test_draining_instances_get_nothing_new() -> None:
    cluster = Cluster(decode=2)
    cluster.beat("d0", free_kv_tokens=4096, draining=True)
    assert {cluster.place(f"r{i}").decode for i in range(4)} == {"d1"}
    cluster.beat("p0", draining=True)
    assert cluster.place("x").reason == "no_prefill_instance"


def test_registration_refuses_an_instance_that_disagrees_with_its_model() -> None:
    cluster = Cluster()
    with pytest.raises(RegistrationConflictError, match="block_size 32 differs from 64"):
        cluster.register("p1", Role.PREFILL, block_size=32)
    with pytest.raises(RegistrationConflictError, match="kv_dtype 'bfloat16' differs from 'float32'"):
        cluster.register("d1", Role.DECODE, kv_dtype="bfloat16")
    # one context window per model: an engine whose config states another is refused
    with pytest.raises(RegistrationConflictError, match="context_window 4096 differs from 8192"):
        cluster.register("d2", Role.DECODE, context_window=4096)
    cluster.register("d3", Role.DECODE, context_window=0)  # not stated (an older engine): not checked
    cluster.register("p9", Role.PREFILL, block_size=16, model="other")  # another model sets its own
    cluster.register("kv0", Role.KVSTORE, block_size=0, kv_format="", kv_dtype="")  # kvstores hold any model
    assert cluster.conductor.model_block_size("m") == 64
    pinned = Conductor(SchedulerSettings(block_size=32))
    with pytest.raises(RegistrationConflictError, match="block_size setting is 32"):
        pinned.register(InstanceSpec(InstanceId("p0"), Role.PREFILL, "p0:1", "m", 64, 0, 0))


def test_placement_with_another_block_size_is_refused() -> None:
    cluster = Cluster()
    keys = tuple(prefix_block_keys(list(range(128)), 32, "m"))
    with pytest.raises(BlockSizeMismatchError, match="block_size 32.*block_size 64"):
        cluster.conductor.place("r", "m", keys, 130, 8, block_size=32)
    assert isinstance(cluster.conductor.place("r", "m", (), 130, 8, block_size=64), Placement)


def test_registered_kvstores_are_shared_sources_and_unregistered_publishers_still_count() -> None:
    cluster = Cluster()
    cluster.register("kv0", Role.KVSTORE, block_size=0)
    keys = tuple(prefix_block_keys(list(range(64 * 6)), 64, "m"))
    cluster.conductor.publish("kv0", [], full_snapshot=True)
    from crescent.services.scheduler.conductor import BlockUpdate
    from crescent.services.scheduler.datatypes import Tier

    cluster.conductor.publish("kv0", [BlockUpdate(True, k, Tier.HOST) for k in keys[:4]], full_snapshot=False)
    cluster.conductor.publish("legacy", [BlockUpdate(True, k, Tier.HOST) for k in keys[:5]], full_snapshot=False)
    assert cluster.conductor.view("m").shared_sources == {"kv0", "legacy"}
    placed = cluster.place("r", prompt=64 * 6 + 3, keys=keys)
    assert isinstance(placed, Placement) and placed.pull is not None and placed.pull.source == "legacy"
    assert placed.cached_blocks == 5


def test_the_decode_outlook_runs_requests_first_in_first_out() -> None:
    from crescent.services.scheduler.decode_outlook import KnownRequest, project_releases

    step = 0.1
    held = [KnownRequest(600, 10, 0.0), KnownRequest(600, 50, 0.0)]  # the second waits: 1200 > 1000
    assert project_releases(held, 1000, 0, step) == [(1.0, 600), (pytest.approx(6.0), 600)]
    # A request on its way joins when it arrives, the ones behind it not before; a batch cap
    # makes each wait for a slot.
    coming = [KnownRequest(100, 10, 0.0), KnownRequest(100, 10, 0.5), KnownRequest(100, 10, 0.5)]
    assert [t for t, _ in project_releases(coming, 1000, 0, step)] == pytest.approx([1.0, 1.5, 1.5])
    assert [t for t, _ in project_releases(coming, 1000, 1, step)] == pytest.approx([1.0, 2.0, 3.0])
    # One larger than the room blocks the queue behind it, as on the instance.
    assert project_releases([KnownRequest(2000, 5, 0.0), KnownRequest(10, 5, 0.0)], 1000, 0, step) == []


def test_a_discovered_instance_with_guessed_details_does_not_refuse_the_real_ones() -> None:
    cluster = Cluster()  # p0 and d0 registered themselves with block_size 64
    guess = InstanceSpec(InstanceId("p1"), Role.PREFILL, "p1:1", "m", 16, 0, 0)  # discovery's assumed block size
    cluster.conductor.register(guess, assumed=True)
    assert cluster.conductor.model_block_size("m") == 64
    cluster.register("p1", Role.PREFILL)  # the instance itself, with its real details
    assert cluster.conductor.registry.get(InstanceId("p1")).spec.block_size == 64


def test_an_instance_reported_unreachable_is_left_out_until_it_heartbeats_again() -> None:
    # Issue 31, finding 8: a dead decode stayed placeable until its heartbeat timeout, so every
    # retry of its streams could land there again (41 re-placements for one kill).
    cluster = Cluster(decode=2)
    cluster.beat("d0", running_requests=4, queued_tokens=2000, free_kv_tokens=1000)  # busier: d1 is preferred
    first = cluster.conductor.place("a-m1", "m", (), 100, 16, unreachable=("d1",))
    assert isinstance(first, Placement) and first.decode == "d0"
    for i in range(5):  # every later placement too, not only the reporter's
        decision = cluster.place(f"b{i}")
        assert isinstance(decision, Placement) and decision.decode == "d0"
    assert cluster.conductor.report_unreachable(["d1"]) == []  # counted once
    cluster.now += 0.5
    cluster.beat("d1", free_kv_tokens=4096)  # alive after all: back in placement at once
    assert isinstance(back := cluster.place("c"), Placement) and back.decode == "d1"


def test_the_only_decode_reported_unreachable_is_no_decode_instance_until_it_is_back() -> None:
    cluster = Cluster(decode=1)
    gone = cluster.conductor.place("a-m1", "m", (), 100, 16, unreachable=("d0",))
    assert isinstance(gone, Rejection) and gone.reason == "no_decode_instance"  # the gateway waits and retries
    cluster.now += 1.0
    cluster.register("d0", Role.DECODE)  # restarted on the same id
    assert isinstance(cluster.place("a-m2"), Placement)


def _full_decode(cluster: Cluster, n: int, prompt: int, max_tokens: int) -> list[object]:
    return [cluster.place(f"r{i}", prompt=prompt, max_tokens=max_tokens) for i in range(n)]


def test_the_decode_kv_wait_is_predicted_from_how_long_requests_really_run() -> None:
    # The measured bug: on 8,192 KV tokens, 4 of 20 requests were refused as decode_kv_full with a
    # predicted 81.9 s while the whole batch finished in 51.8 s: every request was predicted to run
    # its whole max_tokens. Here 20 requests of 290 + 512 (9 fit at once) on one such decode.
    cold = Cluster(kv_capacity=8192, max_batch=16)
    refused = [d for d in _full_decode(cold, 20, 290, 512) if isinstance(d, Rejection)]
    assert refused and all(d.reason == "decode_kv_full" for d in refused)  # nothing observed yet: max_tokens
    assert "expected to run its whole max_tokens" in refused[0].message

    warm = Cluster(kv_capacity=8192, max_batch=16)
    for i in range(20):  # earlier requests of this model stopped after 40 to 59 of their 512 tokens
        rid = f"w{i}"
        assert isinstance(warm.place(rid, prompt=290, max_tokens=512), Placement)
        warm.conductor.outcome(rid, ttft_s=0.3, released=False)
        warm.conductor.outcome(rid, ttft_s=0.0, released=False, finished=True, output_tokens=40 + i)
    for i in range(5):  # and short probes ran to their max_tokens: they say nothing about longer requests
        rid = f"probe{i}"
        assert isinstance(warm.place(rid, prompt=10, max_tokens=2), Placement)
        warm.conductor.outcome(rid, ttft_s=0.0, released=False, finished=True, output_tokens=2)
    assert warm.conductor.output_lengths.length("m") == 57  # the 90th percentile: 18 of 20 stopped by then
    decisions = _full_decode(warm, 20, 290, 512)
    assert all(isinstance(d, Placement) for d in decisions), [d for d in decisions if isinstance(d, Rejection)]


def test_a_finished_outcome_frees_the_decode_promise_and_needs_enough_samples() -> None:
    cluster = Cluster(kv_capacity=1000)
    assert isinstance(cluster.place("a", prompt=400, max_tokens=100), Placement)
    assert cluster.conductor.view("m").decode[0].free_kv_tokens == 500
    cluster.conductor.outcome("a", ttft_s=0.0, released=False, finished=True, output_tokens=10)
    assert cluster.conductor.view("m").decode[0].free_kv_tokens == 1000
    assert cluster.conductor.output_lengths.expected_steps("m", 100) == 100  # one sample is not a calibration


def test_a_request_that_ended_since_the_decode_report_frees_its_kv_and_row_at_once() -> None:
    # A full CI run saw a client's next request refused decode_kv_full: the one that had just
    # ended was still in decode's last report, its KV counted as used until the next heartbeat.
    cluster = Cluster(kv_capacity=1000, max_batch=2)
    for rid in ("a", "b"):
        assert isinstance(cluster.place(rid, prompt=400, max_tokens=100), Placement)
    cluster.beat("d0", running_requests=2, free_kv_tokens=0, active_request_ids=("a", "b"))
    cluster.conductor.outcome("a", ttft_s=0.0, released=False, finished=True, output_tokens=10)
    view = cluster.conductor.view("m").decode[0]
    assert (view.free_kv_tokens, view.batch_size) == (500, 1)
    assert isinstance(cluster.place("c", prompt=400, max_tokens=100), Placement)
    # The next report covers "a"'s end: its KV is not counted free twice.
    cluster.beat("d0", running_requests=1, free_kv_tokens=500, active_request_ids=("b",))
    view = cluster.conductor.view("m").decode[0]
    assert (view.free_kv_tokens, view.batch_size) == (0, 2)
