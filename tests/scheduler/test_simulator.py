"""The trace-driven simulator, running the scheduler's own policies on the FAST'25 trace."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from loadtest.simulator import SimConfig, load_trace, rescale, simulate, summarize
from crescent.services.contract.latency import tbt_seconds as mooncake_tbt
from loadtest.simulator.trace import DEFAULT_TRACE, TraceError
from crescent.services.scheduler.cost_presets import paper_cost_models

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not DEFAULT_TRACE.exists(), reason=f"trace {DEFAULT_TRACE} is not present"),
]


def theoretical_hit_rate(trace) -> float:
    """Share of prompt blocks whose id appeared in any earlier request: the best any cache can do."""
    seen: set[int] = set()
    hits = total = 0
    for r in trace:
        hits += sum(1 for h in r.hash_ids if h in seen)
        total += len(r.hash_ids)
        seen.update(r.hash_ids)
    return hits / total


def test_unbounded_cache_reaches_the_theoretical_hit_rate() -> None:
    trace = load_trace(limit=1200)
    theory = theoretical_hit_rate(trace)
    assert 0.1 < theory < 0.9
    # Arrivals far apart: every earlier request has finished, so every seen block is reusable.
    spaced = rescale(trace, 50.0)
    config = SimConfig(policy="kvcache_centric", prefill_instances=4, decode_instances=4,
                       cache_capacity_tokens=None, remote_threshold_blocks=0)
    result = summarize("unbounded", simulate(spaced, config), config.slo_ttft_s, config.slo_tbt_s)
    assert result.hit_rate == pytest.approx(theory, abs=1e-12)
    # Small per-node caches without pulls from peers fall well short of it.
    small = replace(config, policy="least_loaded", cache_capacity_tokens=200_000, global_cache=False)
    local = summarize("small", simulate(spaced, small), config.slo_ttft_s, config.slo_tbt_s)
    assert local.hit_rate < theory - 0.1


def test_policies_rank_as_in_the_paper_on_16_plus_16() -> None:
    trace = load_trace(limit=1500)
    ttft = {}
    for policy in ("random", "least_loaded", "kvcache_centric"):
        config = SimConfig(policy=policy, prefill_instances=16, decode_instances=16)
        ttft[policy] = summarize(policy, simulate(trace, config), 30, 0.1).ttft_avg
    assert ttft["kvcache_centric"] < ttft["least_loaded"] < ttft["random"], ttft


def test_early_rejection_under_twice_the_capacity() -> None:
    trace = load_trace(limit=400)
    costs = paper_cost_models()
    prefill_instances = 2
    # Compress arrivals so the prompts need twice the prefill time the instances have.
    work_s = sum(costs.prefill.seconds(r.input_length) for r in trace)
    span_s = trace[-1].arrival_s - trace[0].arrival_s
    overloaded = rescale(trace, work_s / (2 * prefill_instances) / span_s)
    base = SimConfig(policy="kvcache_centric", prefill_instances=prefill_instances, decode_instances=8,
                     prefix_caching=False, slo_ttft_s=20.0)
    guarded = summarize("reject", simulate(overloaded, replace(base, reject_early=True)), 20.0, 1.0)
    unguarded = summarize("queue", simulate(overloaded, replace(base, reject_early=False)), 20.0, 1.0)
    # About half the offered work is turned away (fewer requests: long prompts are the ones that do not fit).
    assert 0.3 < 1 - guarded.prefill_tokens / unguarded.prefill_tokens < 0.7
    assert guarded.rejection_rate > 0.05
    assert guarded.ttft_slo_met >= 0.99
    assert unguarded.rejection_rate == 0
    assert unguarded.ttft_slo_met < 0.5         # queueing everyone makes most requests late
    assert guarded.effective_capacity > unguarded.effective_capacity


def test_short_decode_kv_queues_and_rejects_with_true_reasons() -> None:
    # The live Conductor admits here (reservations, decode outlook, policy) on the simulated clock.
    trace = load_trace(limit=400)
    capacity = sorted(r.input_length + r.output_length for r in trace)[int(len(trace) * 0.9)]
    config = SimConfig(policy="kvcache_centric", prefill_instances=8, decode_instances=2, reject_early=True,
                       decode_kv_capacity_tokens=capacity, slo_ttft_s=30.0, slo_tbt_s=0.2)
    runs = {
        "queue": simulate(trace, replace(config, reject_early=False)),
        "ttft": simulate(trace, config),  # a wait at decode is checked against the TTFT SLO
        "tbt": simulate(trace, replace(config, decode_wait_in_tbt=True)),  # ... and counted in the TBT
    }
    too_big = {r.index for r in trace if r.input_length + r.output_length > capacity}
    for name, records in runs.items():  # never worth queueing: refused however admission is set
        assert too_big and {r.index for r in records if r.rejection == "exceeds_kv_capacity"} == too_big, name
        reasons = {r.rejection for r in records if r.rejection}
        assert reasons <= {"exceeds_kv_capacity", "decode_kv_full", "decode_batch_full", "ttft_slo", "tbt_slo"}, name
    assert {r.index for r in runs["queue"] if r.rejection} == too_big
    assert Counter(r.rejection for r in runs["tbt"])["decode_kv_full"] > 0
    summary = {name: summarize(name, records, 30, 0.2) for name, records in runs.items()}
    # A wait for KV is a stall after the first token: bounded by the TTFT SLO alone, it breaks
    # the TBT of most admitted streams; counted in the predicted TBT, what is admitted keeps it.
    admitted = [r for r in runs["tbt"] if r.tbt_s is not None]
    assert sum(r.tbt_s <= 0.2 for r in admitted) / len(admitted) > 0.9
    assert summary["queue"].tbt_avg > 5 * summary["tbt"].tbt_avg
    assert summary["tbt"].effective_capacity > 2 * max(summary["ttft"].effective_capacity, summary["queue"].effective_capacity)
    assert summary["ttft"].ttft_slo_met == 1.0


def test_colocated_baselines_show_interference_and_no_reuse_without_caching() -> None:
    trace = load_trace(limit=600)
    disagg = SimConfig(policy="kvcache_centric", prefill_instances=4, decode_instances=4)
    colo_cache = replace(disagg, policy="cache_aware", colocated=True)
    colo_plain = replace(disagg, policy="least_loaded", colocated=True, prefix_caching=False)
    results = {c: summarize(str(i), simulate(trace, c), 30, 0.1) for i, c in enumerate((disagg, colo_cache, colo_plain))}
    d, cc, cp = results[disagg], results[colo_cache], results[colo_plain]
    assert cp.hit_rate == 0 and cp.prefill_tokens == sum(r.input_length for r in trace)
    assert cc.hit_rate > 0.05 and cc.prefill_tokens < cp.prefill_tokens
    assert d.tbt_avg < cc.tbt_avg  # prefill chunks no longer stretch decode steps
    assert d.effective_capacity > cp.effective_capacity


def test_mooncake_tbt_is_the_mean_of_the_longest_tenth() -> None:
    assert mooncake_tbt([0.01] * 90 + [0.5] * 10) == pytest.approx(0.5)
    assert mooncake_tbt([0.02, 0.04, 0.03]) == pytest.approx(0.04)  # at least one interval
    assert mooncake_tbt([]) is None  # no interval, no TBT (the gateway's metric agrees)


def test_trace_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(TraceError, match="bad.jsonl:2"):
        load_trace(bad)


def test_simulate_cli_prints_figures_and_writes_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    from loadtest import simulate as cli

    assert cli.main(["--limit", "150", "--prefill", "2", "--decode", "2", "--policies", "least_loaded,kvcache_centric",
                     "--colocated-baselines", "--json", "--plots", str(tmp_path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["label"] for line in lines] == ["least_loaded", "kvcache_centric", "colocated+cache", "colocated"]
    assert all(line["requests"] == 150 and line["ttft_avg"] > 0 for line in lines)
    for name in ("summary.png", "ttft_cdf.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
