"""The network-free scheduling core: prefix index, cost models, policies, settings."""

from __future__ import annotations

import random

import pytest

from crescent.services.contract.block_keys import BlockKey, prefix_block_keys
from crescent.services.common.settings import SettingsError
from crescent.services.scheduler.config import load_scheduler_settings
from crescent.services.scheduler.cost_model import (
    DecodeCostModel, DecodeSample, FitError, PrefillCostModel, PrefillSample, fit_decode_model, fit_prefill_model,
)
from crescent.services.scheduler.cost_presets import paper_cost_models
from crescent.services.scheduler.datatypes import (
    DecodeCandidate, InstanceId, Placement, PlacementRequest, PrefillCandidate, Rejection, Slo, SourceId, Tier,
)
from crescent.services.scheduler.policies import POLICIES, UnknownPolicyError, make_policy
from crescent.services.scheduler.placement import ClusterView, PolicyOptions
from crescent.services.scheduler.prefix_index import PrefixIndex


def keys(n: int, tag: int = 0) -> list[BlockKey]:
    return prefix_block_keys(list(range(tag * 10_000, tag * 10_000 + 4 * n)), 4, "m")


# ---- prefix index --------------------------------------------------------------------------

def test_index_reports_leading_blocks_per_source() -> None:
    index = PrefixIndex()
    k = keys(10)
    index.store("a", k[:6])
    index.store("b", k[:3], Tier.HOST)
    index.store("c", k[4:9])         # holds later blocks but not the first: no usable prefix
    index.store("d", k[:2] + k[3:8])  # a hole at block 2 ends its prefix there
    assert index.match(k).by_source == {"a": 6, "b": 3, "d": 2}
    assert index.tiers("b", k[:3]) == [Tier.HOST] * 3
    index.remove("a", [k[4]])
    assert index.match(k).by_source["a"] == 4
    assert index.match(keys(3, tag=1)).by_source == {}


def test_index_snapshot_replaces_and_drop_forgets() -> None:
    index = PrefixIndex()
    k = keys(6)
    index.store("a", k)
    index.replace_source("a", [(key, Tier.DISK) for key in k[:2]])
    assert index.match(k).by_source == {"a": 2}
    assert index.tiers("a", k[:2]) == [Tier.DISK, Tier.DISK]
    index.store("b", k[:3])
    index.drop_source("a")
    assert index.match(k).by_source == {"b": 3}
    assert len(index) == 3
    index.store("e", k[:1])          # a new source reuses the freed slot without inheriting blocks
    assert index.match(k).by_source == {"b": 3, "e": 1}


def test_index_memory_is_bounded_and_forgets_oldest_first() -> None:
    index = PrefixIndex(max_blocks=5)
    old, new = keys(4, tag=1), keys(4, tag=2)
    index.store("a", old)
    index.store("a", new)
    assert len(index) == 5
    assert index.match(new).by_source == {"a": 4}
    assert index.match(old).by_source == {}  # forgetting only under-counts, never invents hits
    assert index.blocks_of("a") == 5


def test_index_matches_a_brute_force_reference() -> None:
    rng = random.Random(7)
    chains = [keys(12, tag=t) for t in range(5)]
    index = PrefixIndex()
    held: dict[str, set[bytes]] = {s: set() for s in "abcdef"}
    for _ in range(400):
        src = rng.choice("abcdef")
        chain = rng.choice(chains)
        chosen = rng.sample(chain, rng.randint(1, 6))
        if rng.random() < 0.7:
            index.store(src, chosen)
            held[src].update(chosen)
        else:
            index.remove(src, chosen)
            held[src].difference_update(chosen)
        for probe in chains:
            expect = {}
            for s, blocks in held.items():
                n = 0
                while n < len(probe) and probe[n] in blocks:
                    n += 1
                if n:
                    expect[s] = n
            assert index.match(probe).by_source == expect


# ---- cost models ---------------------------------------------------------------------------

def test_fitted_prefill_model_recovers_the_truth() -> None:
    truth = PrefillCostModel(fixed_s=0.03, per_token_s=0.002, attention_s=3e-7)
    samples = [PrefillSample(u, c, truth.seconds(u, c) * (1 + 0.01 * ((u + c) % 3 - 1)))
               for u in (128, 512, 1024, 2048) for c in (0, 512, 2048)]
    fitted = fit_prefill_model(samples)
    for u, c in ((300, 0), (1500, 1000), (4000, 0)):
        assert fitted.seconds(u, c) == pytest.approx(truth.seconds(u, c), rel=0.05)
    with pytest.raises(FitError):
        fit_prefill_model(samples[:2])


def test_fitted_decode_model_recovers_the_truth() -> None:
    truth = DecodeCostModel(fixed_s=0.05, per_sequence_s=0.004, per_context_token_s=2e-6)
    samples = [DecodeSample(b, ctx, truth.step_seconds(b, ctx)) for b in (1, 2, 4, 8) for ctx in (100, 4000, 16000)]
    fitted = fit_decode_model(samples)
    assert fitted.step_seconds(6, 9000) == pytest.approx(truth.step_seconds(6, 9000), rel=1e-6)
    assert min(fitted.fixed_s, fitted.per_sequence_s, fitted.per_context_token_s) >= 0


def test_paper_preset_follows_the_flops_formula() -> None:
    costs = paper_cost_models()
    n = 8192
    layers, d, a, b = 80, 8192, 2.0, 26.0
    flops = layers * (a * n * n * d + b * n * d * d)
    expected = flops / (8 * 312e12 * 0.45) + 0.005
    assert costs.prefill.seconds(n) == pytest.approx(expected, rel=1e-9)
    # Cached tokens make the new ones cheaper than a cold prompt of the same total length.
    assert costs.prefill.seconds(n // 2, n // 2) < costs.prefill.seconds(n)
    assert costs.transfer.seconds(n, Tier.ENGINE) < costs.prefill.seconds(n) / 10


# ---- policies ------------------------------------------------------------------------------

COSTS = paper_cost_models()


def view(index: PrefixIndex, queues: dict[str, float], decode: list[DecodeCandidate] | None = None) -> ClusterView:
    prefill = [PrefillCandidate(InstanceId(i), q) for i, q in queues.items()]
    decode = decode if decode is not None else [DecodeCandidate(InstanceId("d0"), 0, 0, 10**9)]
    return ClusterView(prefill, decode, index)


def request(k: list[BlockKey], tokens: int | None = None) -> PlacementRequest:
    return PlacementRequest("r", tuple(k), tokens or len(k) * 512, 100, 512)


def test_unknown_policy_lists_the_valid_names() -> None:
    with pytest.raises(UnknownPolicyError, match="kvcache_centric"):
        make_policy("fastest", COSTS, Slo(10, 1))
    with pytest.raises(SettingsError) as err:
        load_scheduler_settings(None, policy={"name": "fastest"})
    assert "policy.name" in str(err.value) and "round_robin" in str(err.value)
    assert set(POLICIES) == {"random", "round_robin", "least_loaded", "cache_aware", "kvcache_centric"}


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRESCENT_SCHEDULER__POLICY__NAME", "least_loaded")
    monkeypatch.setenv("CRESCENT_SCHEDULER__SLO__TTFT_S", "2.5")
    settings = load_scheduler_settings(None)
    assert settings.policy.name == "least_loaded" and settings.slo.ttft_s == 2.5
    with pytest.raises(SettingsError, match="heartbeat_timeout_s"):
        load_scheduler_settings(None, heartbeat_interval_s=5, heartbeat_timeout_s=2)


def test_kvcache_centric_pulls_a_remote_prefix_to_an_idle_instance() -> None:
    index = PrefixIndex()
    k = keys(30)
    index.store("p0", k[:28])
    policy = make_policy("kvcache_centric", COSTS, Slo(100, 10))
    # p0 holds the prefix but is busy for 20 s; moving 28 blocks to idle p1 is far cheaper.
    decision = policy.place(request(k), view(index, {"p0": 20.0, "p1": 0.0}))
    assert isinstance(decision, Placement)
    assert decision.prefill == "p1" and decision.pull is not None
    assert (decision.pull.source, decision.pull.blocks) == ("p0", 28)
    assert decision.cached_blocks == 28
    # cache_aware sees only local prefixes: p1 would recompute everything, so it waits for p0.
    local = make_policy("cache_aware", COSTS, Slo(100, 10)).place(request(k), view(index, {"p0": 1.0, "p1": 0.0}))
    assert isinstance(local, Placement) and local.prefill == "p0" and local.pull is None


def test_remote_threshold_keeps_short_wins_local() -> None:
    index = PrefixIndex()
    k = keys(30)
    index.store("p0", k[:12])
    index.store("p1", k[:10])
    options = PolicyOptions(remote_prefix_threshold_blocks=4)
    policy = make_policy("kvcache_centric", COSTS, Slo(100, 10), options)
    decision = policy.place(request(k), view(index, {"p0": 30.0, "p1": 0.0}))
    assert isinstance(decision, Placement)
    assert decision.prefill == "p1" and decision.pull is None and decision.local_blocks == 10


def test_early_rejection_names_the_slo_and_a_retry_after() -> None:
    index = PrefixIndex()
    k = keys(16)
    slo = Slo(ttft_s=5.0, tbt_s=0.1)
    policy = make_policy("kvcache_centric", COSTS, slo)
    busy = policy.place(request(k), view(index, {"p0": 12.0, "p1": 9.0}))
    assert isinstance(busy, Rejection) and busy.reason == "ttft_slo"
    assert busy.retry_after_s >= 9.0 - 5.0
    crowded = [DecodeCandidate(InstanceId("d0"), 200, 3_000_000, 10**9)]
    slow = policy.place(request(k), view(index, {"p0": 0.0}, crowded))
    assert isinstance(slow, Rejection) and slow.reason == "tbt_slo"
    lenient = make_policy("kvcache_centric", COSTS, Slo(5.0, 0.1, reject_early=False))
    assert isinstance(lenient.place(request(k), view(index, {"p0": 12.0, "p1": 9.0})), Placement)


def test_decode_by_predicted_tbt_skips_full_instances() -> None:
    decode = [
        DecodeCandidate(InstanceId("small"), 1, 1000, free_kv_tokens=100),  # no room for the request
        DecodeCandidate(InstanceId("busy"), 40, 600_000, free_kv_tokens=10**7),
        DecodeCandidate(InstanceId("calm"), 10, 50_000, free_kv_tokens=10**7),
    ]
    policy = make_policy("kvcache_centric", COSTS, Slo(100, 10))
    decision = policy.place(request(keys(4)), view(PrefixIndex(), {"p0": 0.0}, decode))
    assert isinstance(decision, Placement) and decision.decode == "calm"
    full = [DecodeCandidate(InstanceId("small"), 1, 1000, free_kv_tokens=100)]
    assert make_policy("least_loaded", COSTS, Slo(100, 10)).place(
        request(keys(4)), view(PrefixIndex(), {"p0": 0.0}, full)).reason == "decode_kv_full"


def test_baselines_choose_as_their_names_say() -> None:
    index = PrefixIndex()
    queues = {"p0": 3.0, "p1": 1.0, "p2": 2.0}
    least = make_policy("least_loaded", COSTS, Slo(100, 10))
    assert least.place(request(keys(2)), view(index, queues)).prefill == "p1"
    rr = make_policy("round_robin", COSTS, Slo(100, 10))
    assert [rr.place(request(keys(2)), view(index, queues)).prefill for _ in range(4)] == ["p0", "p1", "p2", "p0"]
    rnd = make_policy("random", COSTS, Slo(100, 10), PolicyOptions(seed=3))
    picks = {rnd.place(request(keys(2)), view(index, queues)).prefill for _ in range(60)}
    assert picks == {"p0", "p1", "p2"}


def test_shared_kvstore_prefix_is_reachable_by_every_policy() -> None:
    index = PrefixIndex()
    k = keys(8)
    index.store("kv", k[:6], Tier.HOST)
    v = ClusterView([PrefillCandidate(InstanceId("p0"), 0.0)], [DecodeCandidate(InstanceId("d0"), 0, 0, None)],
                    index, frozenset({SourceId("kv")}))
    for name in POLICIES:
        decision = make_policy(name, COSTS, Slo(100, 10)).place(request(k), v)
        assert isinstance(decision, Placement) and decision.cached_blocks == 6, name


def test_conductor_spreads_a_burst_between_heartbeats_and_expires_silent_instances() -> None:
    from crescent.services.scheduler.conductor import Conductor
    from crescent.services.scheduler.config import SchedulerSettings
    from crescent.services.scheduler.datatypes import Role
    from crescent.services.scheduler.registry import InstanceSpec, LoadReport

    now = [0.0]
    conductor = Conductor(SchedulerSettings(heartbeat_timeout_s=3.0), clock=lambda: now[0])
    for name in ("p0", "p1"):
        conductor.register(InstanceSpec(InstanceId(name), Role.PREFILL, f"{name}:1", "m", 4, 0, 0))
    conductor.register(InstanceSpec(InstanceId("d0"), Role.DECODE, "d0:1", "m", 4, 0, 0))
    # No heartbeat in between: the placements themselves must count as load.
    chosen = [conductor.place(f"r{i}", "m", tuple(keys(50, tag=i)), 200, 8).prefill for i in range(4)]
    assert sorted(chosen) == ["p0", "p0", "p1", "p1"]
    now[0] = 2.0
    assert conductor.heartbeat(InstanceId("p1"), LoadReport()) and conductor.heartbeat(InstanceId("d0"), LoadReport())
    now[0] = 4.0
    assert conductor.expire() == ["p0"]
    assert {conductor.place("x", "m", (), 10, 8).prefill for _ in range(3)} == {"p1"}
    assert not conductor.heartbeat(InstanceId("p0"), LoadReport())
