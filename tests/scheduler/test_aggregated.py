"""Aggregated instances (prefill and decode in one process) are placed by the same Conductor:
a candidate for either role, decoding what it prefilled when it fits there (no KV moves), with
its prompts' queue and its decoding sequences reported and reserved apart."""

from __future__ import annotations

import pytest

from crescent.services.scheduler.conductor import Conductor
from crescent.services.scheduler.config import SchedulerSettings
from crescent.services.scheduler.datatypes import InstanceId, Placement, Role
from crescent.services.scheduler.registry import InstanceSpec, LoadReport


class Aggregated:
    def __init__(self, count: int, kv_capacity: int = 4096) -> None:
        self.now = 0.0
        self.conductor = Conductor(SchedulerSettings(), clock=lambda: self.now)
        for i in range(count):
            self.conductor.register(InstanceSpec(InstanceId(f"a{i}"), Role.AGGREGATED, f"a{i}:1", "m", 64,
                                                 kv_capacity, 8, "paged-v1", "float32"))

    def beat(self, name: str, **load: object) -> None:
        assert self.conductor.heartbeat(InstanceId(name), LoadReport(**load))


def test_an_aggregated_instance_prefills_and_decodes_the_request_itself() -> None:
    cluster = Aggregated(1)
    placed = cluster.conductor.place("r", "m", (), 300, 50)
    assert isinstance(placed, Placement)
    assert placed.prefill == placed.decode == "a0"
    view = cluster.conductor.view("m")
    assert [p.instance_id for p in view.prefill] == ["a0"] and [d.instance_id for d in view.decode] == ["a0"]
    assert view.decode[0].free_kv_tokens == 4096 - 350  # its decode reservation
    assert view.prefill[0].queued_requests == 1         # and its prefill one, in a book of its own
    # The first token retires the prefill reservation only; the KV promise stays until decode reports.
    cluster.conductor.outcome("r", ttft_s=0.3, released=False)
    view = cluster.conductor.view("m")
    assert view.prefill[0].queued_requests == 0 and view.decode[0].free_kv_tokens == 4096 - 350


def test_the_prefill_queue_comes_from_the_prompt_fields_not_the_decoding_ones() -> None:
    cluster = Aggregated(2)
    # a0 decodes a lot but prefills nothing; a1 has a long prompt queue.
    cluster.beat("a0", running_requests=6, queued_tokens=6 * 500, free_kv_tokens=4096 - 3000)
    cluster.beat("a1", prefill_queued_requests=3, prefill_queued_tokens=6000, prefill_running_requests=1,
                 free_kv_tokens=4096)
    view = cluster.conductor.view("m")
    queue = {p.instance_id: p.queue_s for p in view.prefill}
    assert queue["a0"] == 0.0 and queue["a1"] > 0.0
    placed = cluster.conductor.place("r", "m", (), 200, 20)
    assert isinstance(placed, Placement) and placed.prefill == "a0"
    assert placed.decode == "a0"  # it fits there: no KV crosses to a1


def test_aggregated_instances_count_as_both_roles_and_disaggregated_pairs_are_unchanged() -> None:
    cluster = Aggregated(1)
    cluster.conductor.register(InstanceSpec(InstanceId("p0"), Role.PREFILL, "p0:1", "m", 64, 0, 0, "paged-v1", "float32"))
    live = cluster.conductor.registry
    assert {r.spec.instance_id for r in live.live(Role.PREFILL)} == {"a0", "p0"}
    assert {r.spec.instance_id for r in live.live(Role.DECODE)} == {"a0"}
    assert not Role.PREFILL.serves(Role.DECODE) and Role.AGGREGATED.serves(Role.PREFILL)


def test_with_a_mixed_step_fit_an_aggregated_prompt_pays_its_steps_beside_the_decoding_rows() -> None:
    from crescent.services.scheduler.config import CostSettings, MixedStepCostSettings
    from crescent.services.scheduler.cost_model import MixedPrefillCost, MixedStepCostModel, PrefillCostModel

    mixed = MixedStepCostSettings(fixed_s=0.02, per_prompt_token_s=0.001, attention_s=0.0, per_sequence_s=0.005,
                                  per_context_token_s=0.0)
    settings = SchedulerSettings(cost=CostSettings(mixed=mixed), aggregated_chunk_tokens=256)
    now = [0.0]
    conductor = Conductor(settings, clock=lambda: now[0])
    for name in ("busy", "idle"):
        conductor.register(InstanceSpec(InstanceId(name), Role.AGGREGATED, f"{name}:1", "m", 64, 8192, 16,
                                        "paged-v1", "float32"))
    conductor.register(InstanceSpec(InstanceId("p0"), Role.PREFILL, "p0:1", "m", 64, 0, 0, "paged-v1", "float32"))
    assert conductor.heartbeat(InstanceId("busy"), LoadReport(running_requests=12, queued_tokens=12 * 300,
                                                             free_kv_tokens=8192 - 3600))
    assert conductor.heartbeat(InstanceId("idle"), LoadReport(free_kv_tokens=8192))
    costs = {p.instance_id: p.prefill_cost for p in conductor.view("m").prefill}
    assert costs["p0"] is None  # a prefill instance keeps the cluster's prefill model
    # A 1,000-token prompt takes 4 chunks of at most 256: 4 steps of 0.02 s + 12 rows x 0.005 s, + 1 ms a token.
    assert costs["busy"] == MixedPrefillCost(conductor.costs.mixed, 256, 12, 3600)
    assert costs["busy"].seconds(1000) == pytest.approx(4 * (0.02 + 12 * 0.005) + 1.0)
    assert costs["idle"].seconds(1000) == pytest.approx(4 * 0.02 + 1.0)
    # The whole prompt's query-key pairs, however it is chunked: the same attention term as one forward.
    attention_only = MixedPrefillCost(MixedStepCostModel(0.0, 0.0, 1e-6, 0.0, 0.0), 256)
    assert attention_only.seconds(1000, 200) == pytest.approx(PrefillCostModel(0.0, 0.0, 1e-6).seconds(1000, 200))
    # The TTFT the Conductor predicts (and holds the SLO to) is the mixed one.
    conductor.deregister(InstanceId("p0"))
    placed = conductor.place("r", "m", (), 1000, 20)
    assert isinstance(placed, Placement) and placed.prefill == "idle"
    assert placed.predicted_ttft_s == pytest.approx(4 * 0.02 + 1.0)
