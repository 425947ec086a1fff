"""n choices of one prompt are placed once: decode holds the n-choice KV (the prompt's full blocks
shared) and runs n rows of its batch."""

from __future__ import annotations

import grpc
import pytest

from crescent.protos import scheduler_pb2
from crescent.services.contract.choices import choices_kv_tokens
from crescent.services.scheduler.datatypes import Placement, Rejection
from crescent.services.scheduler.decode_outlook import KnownRequest, project_releases

from .support import instance
from .test_admission import Cluster

BLOCK = 64  # Cluster's block size


def test_n_choices_reserve_their_shared_kv_and_n_batch_rows_on_decode() -> None:
    cluster = Cluster(kv_capacity=4096, max_batch=8)
    placed = cluster.conductor.place("c", "m", (), 100, 50, n=3)
    assert isinstance(placed, Placement)
    need = choices_kv_tokens(100, 50, 3, BLOCK)
    assert need == 150 + 2 * (100 % BLOCK + 50)  # less than three requests' 450
    d0 = cluster.conductor.view("m").decode[0]
    assert (d0.free_kv_tokens, d0.batch_size) == (4096 - need, 3)
    # Once decode reports it, its own figures cover it: counted once.
    cluster.beat("d0", running_requests=3, free_kv_tokens=4096 - need, active_request_ids=("c",))
    assert cluster.conductor.view("m").decode[0].free_kv_tokens == 4096 - need


def test_one_choice_reserves_exactly_prompt_plus_max_tokens() -> None:
    cluster = Cluster(kv_capacity=4096)
    assert isinstance(cluster.conductor.place("c", "m", (), 100, 50, n=1), Placement)
    assert cluster.conductor.view("m").decode[0].free_kv_tokens == 4096 - 150


def test_choices_larger_than_every_decode_instance_are_refused_while_one_fits() -> None:
    cluster = Cluster(decode=2, kv_capacity=1024)
    assert isinstance(cluster.conductor.place("one", "m", (), 600, 200, n=1), Placement)  # 800 tokens
    refused = cluster.conductor.place("three", "m", (), 600, 200, n=3)
    assert isinstance(refused, Rejection) and refused.reason == "exceeds_kv_capacity"
    need = choices_kv_tokens(600, 200, 3, BLOCK)
    assert need > 1024 and str(need) in refused.message and "3 choices" in refused.message


def test_n_rows_make_a_slower_predicted_step() -> None:
    one = Cluster(kv_capacity=100_000).conductor.place("r", "m", (), 500, 100, n=1)
    many = Cluster(kv_capacity=100_000).conductor.place("r", "m", (), 500, 100, n=8)
    assert isinstance(one, Placement) and isinstance(many, Placement)
    assert many.predicted_tbt_s > one.predicted_tbt_s


def test_the_decode_outlook_counts_each_choice_as_a_batch_row() -> None:
    step = 0.1
    # Cap 4: three rows then two do not run together.
    rows = [KnownRequest(100, 10, 0.0, sequences=3), KnownRequest(100, 10, 0.0, sequences=2)]
    assert [t for t, _ in project_releases(rows, 1000, 4, step)] == pytest.approx([1.0, 2.0])
    # One wider than the cap still runs (decode steps it in parts) rather than blocking forever.
    assert project_releases([KnownRequest(100, 10, 0.0, sequences=6)], 1000, 4, step) == [(pytest.approx(1.0), 100)]


def place(stub, n: int) -> scheduler_pb2.Placement:
    return stub.Place(scheduler_pb2.PlaceRequest(request_id=f"r{n}", model_id="m", prompt_tokens=64, max_tokens=16, n=n))


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_n_reaches_the_scheduler_through_grpc(start_scheduler) -> None:
    sched = start_scheduler()
    sched.stub.Register(instance("p0", "prefill"))
    sched.stub.Register(instance("d0", "decode", kv_capacity_tokens=100))  # block_size 4
    assert not place(sched.stub, 0).HasField("rejection")  # 0: one choice, 80 tokens
    refused = place(sched.stub, 3).rejection
    assert refused.reason == "exceeds_kv_capacity"
    assert str(choices_kv_tokens(64, 16, 3, 4)) in refused.message and "3 choices" in refused.message
    with pytest.raises(grpc.RpcError) as err:
        place(sched.stub, 17)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be" in err.value.details()
