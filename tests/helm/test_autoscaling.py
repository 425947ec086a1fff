"""Autoscalers that can read their metrics: HPAs only with prometheus-adapter's rules, every query
checked against the metrics contract and run by promtool on sample series."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.test_observability import _base_name, _contract_names
from tests.helm.tools import EXAMPLES, by_kind, helm_template, render, run, tool

ADAPTER_ON = ["--set", "monitoring.prometheusAdapter.enabled=true"]


def _adapter_values(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The values file for the prometheus-adapter chart the chart renders."""
    (config_map,) = [d for n, d in by_kind(docs, "ConfigMap").items() if n.endswith("-prometheus-adapter")]
    return yaml.safe_load(config_map["data"]["values.yaml"])


def _adapter_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return _adapter_values(docs)["rules"]["custom"]


def _as_promql(metrics_query: str, series: str, matchers: str, group_by: str) -> str:
    """The query the adapter sends for one HPA read (its Go template filled in as it does)."""
    return (metrics_query.replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)
            .replace("<<.GroupBy>>", group_by))


@pytest.mark.parametrize("role", ["prefill", "decode", "aggregated"])
def test_hpa_without_the_adapter_rules_is_refused(role: str) -> None:
    on = ["--set", "aggregated.enabled=true"] if role == "aggregated" else []
    result = helm_template(*on, "--set", f"{role}.autoscaling.enabled=true")
    assert result.returncode != 0
    assert "monitoring.prometheusAdapter.enabled" in result.stderr and f"{role}.autoscaling.keda.enabled" in result.stderr
    # KEDA reads Prometheus itself: no adapter needed.
    assert helm_template(*on, "--set", f"{role}.autoscaling.enabled=true",
                         "--set", f"{role}.autoscaling.keda.enabled=true").returncode == 0


def _source_series(rule: dict[str, Any]) -> str:
    """The exported series an adapter rule reads (its seriesQuery's metric)."""
    return rule["seriesQuery"].split("{", 1)[0]


@pytest.mark.parametrize("source", ["four-supernodes", "all-hpa", "aggregated-small"])
def test_every_hpa_metric_has_an_adapter_rule_and_exists(source: str) -> None:
    if source == "four-supernodes":
        docs = render(values=[EXAMPLES / "four-supernodes.yaml"])
    elif source == "aggregated-small":
        docs = render(values=[EXAMPLES / "aggregated-small.yaml"])
    else:
        docs = render("--set", "prefill.autoscaling.enabled=true", "--set", "decode.autoscaling.enabled=true",
                      "--set", "aggregated.enabled=true", "--set", "aggregated.autoscaling.enabled=true", *ADAPTER_ON)
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpas
    served = {rule["name"]["as"]: rule for rule in _adapter_rules(docs)}
    contract = _contract_names()
    for name, hpa in hpas.items():
        assert hpa["spec"]["metrics"]
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "Pods"
            wanted = metric["pods"]["metric"]["name"]
            assert wanted in served, f"{name} scales on {wanted}, which no adapter rule serves"
            rule = served[wanted]
            assert re.match(rule["name"]["matches"], _source_series(rule))
            assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
            # What the rule reads is exported: the series it discovers and every one its query names.
            for series in {_source_series(rule), *re.findall(r"\b(crescent_[a-z0-9_]+)", rule["metricsQuery"])}:
                assert series in contract, f"{name}: {wanted} reads {series}, which the services do not export"
            # A metric served under its own name is that metric; only a derived one is renamed.
            assert wanted == _source_series(rule) or wanted not in contract


def test_adapter_queries_return_one_value_per_pod(tmp_path: Path) -> None:
    """promtool evaluates each rule's query, filled in as the adapter fills it, on sample series."""
    rules = _adapter_rules(render(*ADAPTER_ON))
    assert {rule["name"]["as"] for rule in rules} == {
        "crescent_engine_queue_depth", "crescent_engine_running_requests", "crescent_engine_kv_used_ratio"}
    recording, expected = [], []
    # Every series any rule reads: p1 holds 3 (of 10 KV slots), p2 5; an aggregated pod reports
    # its prompts and its decoding sequences under two roles, summed per pod.
    series = [{"series": 'crescent_engine_kv_capacity_tokens{namespace="serving",pod="p1",role="decode"}', "values": "10x5"},
              {"series": 'crescent_engine_kv_capacity_tokens{namespace="serving",pod="p2",role="decode"}', "values": "10x5"}]
    for metric in {_source_series(rule) for rule in rules}:
        series += [
            {"series": f'{metric}{{namespace="serving",pod="p1",role="prefill"}}', "values": "1x5"},
            {"series": f'{metric}{{namespace="serving",pod="p1",role="decode"}}', "values": "2x5"},
            {"series": f'{metric}{{namespace="serving",pod="p2",role="decode"}}', "values": "5x5"},
            {"series": f'{metric}{{namespace="other",pod="p1",role="decode"}}', "values": "100x5"},
        ]
    for i, rule in enumerate(rules):
        record = f"adapter:query_{i}"
        recording.append({"record": record, "expr": _as_promql(
            rule["metricsQuery"], _source_series(rule), 'namespace="serving",pod=~"p1|p2"', "pod")})
        scale = 10 if rule["name"]["as"] == "crescent_engine_kv_used_ratio" else 1
        expected.append({"eval_time": "2m", "expr": record, "exp_samples": [
            {"labels": f'{record}{{pod="p1"}}', "value": 3 / scale}, {"labels": f'{record}{{pod="p2"}}', "value": 5 / scale}]})
    (tmp_path / "adapter.yml").write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": recording}]}))
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": ["adapter.yml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": expected}]}))
    result = run([tool("promtool"), "test", "rules", str(tmp_path / "test.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_keda_queries_name_exported_metrics_and_parse(tmp_path: Path) -> None:
    docs = render("--set", "prefill.autoscaling.enabled=true", "--set", "prefill.autoscaling.keda.enabled=true",
                  "--set", "decode.autoscaling.enabled=true", "--set", "decode.autoscaling.keda.enabled=true",
                  "--set", "aggregated.enabled=true", "--set", "aggregated.autoscaling.keda.enabled=true")
    queries = [t["metadata"]["query"] for obj in by_kind(docs, "ScaledObject").values() for t in obj["spec"]["triggers"]]
    assert len(queries) == 2 + 2 + 3  # aggregated: queue, TBT and KV use
    contract = _contract_names()
    for query in queries:
        for name in re.findall(r"\b(crescent_[a-z0-9_]+)", query):
            assert _base_name(name) in contract, name
    rules = [{"record": f"keda:query_{i}", "expr": q} for i, q in enumerate(queries)]
    (tmp_path / "keda.yml").write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": rules}]}))
    result = run([tool("promtool"), "check", "rules", str(tmp_path / "keda.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_adapter_configmap_goes_to_the_adapters_namespace() -> None:
    docs = render(values=[EXAMPLES / "four-supernodes.yaml"])
    (config_map,) = [d for n, d in by_kind(docs, "ConfigMap").items() if n.endswith("-prometheus-adapter")]
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert "prometheus-adapter" not in " ".join(by_kind(render(), "ConfigMap"))


def test_aggregated_keda_scales_on_queue_tbt_and_the_groups_kv_use() -> None:
    docs = render("--set", "aggregated.enabled=true", "--set", "aggregated.autoscaling.keda.enabled=true",
                  "--set", "aggregated.autoscaling.kvUsedRatioTarget=0.9", "--set", "prefill.enabled=false",
                  "--set", "decode.enabled=false")
    (obj,) = by_kind(docs, "ScaledObject").values()
    assert obj["spec"]["scaleTargetRef"]["name"] == "crescent-aggregated-g0"
    triggers = {t["metadata"]["query"]: (t["metricType"], t["metadata"]["threshold"]) for t in obj["spec"]["triggers"]}
    pods = 'namespace="serving",pod=~"crescent-aggregated-g0-[a-z0-9]{1,10}-[a-z0-9]{5}"'
    assert triggers == {
        f"sum(crescent_engine_queue_depth{{{pods}}})": ("AverageValue", "4"),
        # Its mixed steps: each running stream's time between tokens, against 80% of the TBT SLO.
        f'histogram_quantile(0.99, sum by (le) (rate(crescent_engine_step_seconds_bucket{{{pods},role="decode"}}[2m])))':
            ("Value", "0.08"),
        f"sum(crescent_engine_kv_used_tokens{{{pods}}}) / clamp_min(sum(crescent_engine_kv_capacity_tokens{{{pods}}}), 1)":
            ("Value", "0.9"),
    }


def test_the_adapter_rules_are_added_never_replacing_the_adapters_own() -> None:
    """A values file for the prometheus-community chart holding rules.custom alone: the adapter
    keeps its default rules and every other app's (rules.existing would replace them all)."""
    values = _adapter_values(render(*ADAPTER_ON))
    assert values == {"rules": {"custom": _adapter_rules(render(*ADAPTER_ON))}}
    assert values["rules"]["custom"]


KEDA_ALL = ["--set", "aggregated.enabled=true"] + [
    arg for role in ("prefill", "decode", "aggregated")
    for arg in ("--set", f"{role}.autoscaling.enabled=true", "--set", f"{role}.autoscaling.keda.enabled=true")]


@pytest.mark.parametrize("role", ["prefill", "decode", "aggregated"])
def test_keda_scales_down_after_the_charts_stabilization_window(role: str) -> None:
    """KEDA's cooldownPeriod only governs scaling to zero; scaling down is its HPA's behavior."""
    for window, args in ((600, []), (900, ["--set", f"{role}.autoscaling.scaleDownStabilizationSeconds=900"])):
        docs = render(*KEDA_ALL, *args)
        scaled = by_kind(docs, "ScaledObject")[f"crescent-{role}-g0"]["spec"]
        assert scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == {
            "scaleUp": {"stabilizationWindowSeconds": 0}, "scaleDown": {"stabilizationWindowSeconds": window}}
        assert scaled["cooldownPeriod"] == window
        hpa = by_kind(render("--set", "aggregated.enabled=true", "--set", f"{role}.autoscaling.enabled=true",
                             *ADAPTER_ON, *args), "HorizontalPodAutoscaler")[f"crescent-{role}-g0"]
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == window


# Pod names as Kubernetes makes them: a Deployment's "<name>-<template hash>-<5>", a
# LeaderWorkerSet's leaders "<name>-<i>" and workers "<name>-<i>-<j>". Group "g0-a" is the
# neighbour whose names a bare prefix "crescent-<role>-g0-" would also take in.
def _pod_names(workload: str, multi_node: bool) -> list[str]:
    return [f"{workload}-0", f"{workload}-0-1", f"{workload}-1"] if multi_node else \
        [f"{workload}-7d9f8c6b5-x2k4q", f"{workload}-59b7c4d8f-m8z2p"]


@pytest.mark.parametrize("multi_node", [False, True], ids=["deployment", "leaderworkerset"])
@pytest.mark.parametrize("role", ["prefill", "decode", "aggregated"])
def test_keda_queries_see_only_their_own_groups_pods(tmp_path: Path, role: str, multi_node: bool) -> None:
    """promtool evaluates each trigger of group g0's ScaledObject on series from g0's pods, from
    group g0-a's pods and from another namespace: only g0's count."""
    multi = ["--set", f"{role}.multiNode.enabled=true", "--set-json", f'{role}.multiNode.workerArgs=["w"]'] if multi_node else []
    docs = render(*KEDA_ALL, *multi, "--set-json", 'topology.groups=[{"name":"g0"},{"name":"g0-a"}]')
    triggers = by_kind(docs, "ScaledObject")[f"crescent-{role}-g0"]["spec"]["triggers"]
    mine, neighbour = (_pod_names(f"crescent-{role}-{g}", multi_node) for g in ("g0", "g0-a"))
    step_role = "prefill" if role == "prefill" else "decode"
    series = []
    for pods, namespace, value, slow in ((mine, "serving", 1, False), (neighbour, "serving", 100, True),
                                         (mine, "other", 100, True)):
        for pod in pods:
            labels = f'namespace="{namespace}",pod="{pod}"'
            for metric in ("crescent_engine_queue_depth", "crescent_engine_running_requests",
                           "crescent_engine_kv_used_tokens"):
                series.append({"series": f"{metric}{{{labels},role=\"{step_role}\"}}", "values": f"{value}x10"})
            series.append({"series": f"crescent_engine_kv_capacity_tokens{{{labels}}}", "values": "10x10"})
            # Steps of 0.01 s for g0; of 2 s elsewhere.
            for le, per_minute in (("0.01", 0 if slow else 60), ("2.0", 60), ("+Inf", 60)):
                series.append({"series": f'crescent_engine_step_seconds_bucket{{{labels},role="{step_role}",le="{le}"}}',
                               "values": f"0+{per_minute}x10"})
    own = len(mine)
    expected = [own * 1.0, 0.01 * 0.99, own * 1.0 / (own * 10)]  # the group's sum, its p99 step, its KV share
    rules, tests = [], []
    for i, trigger in enumerate(triggers):
        record = f"keda:trigger_{i}"
        # Rounded to a millionth: a quantile is interpolated in floating point.
        rules.append({"record": record, "expr": f"round(({trigger['metadata']['query']}) * 1e6) / 1e6"})
        tests.append({"eval_time": "5m", "expr": record, "exp_samples": [{"labels": record, "value": expected[i]}]})
    (tmp_path / "keda.yml").write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": rules}]}))
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": ["keda.yml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}))
    result = run([tool("promtool"), "test", "rules", str(tmp_path / "test.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_group_name_too_long_for_its_pods_names_is_refused_with_keda() -> None:
    """Kubernetes cuts a generated pod name's base to 58 characters, which would break the
    per-group pod-name match; the chart says so instead of scaling on nothing."""
    keda = ["--set", "decode.autoscaling.enabled=true", "--set", "decode.autoscaling.keda.enabled=true"]
    result = helm_template(*keda, "--set", "fullnameOverride=a-very-long-release-name-for-a-platform-x")
    assert result.returncode != 0 and "decode.autoscaling.keda" in result.stderr
    assert helm_template(*keda, "--set", "fullnameOverride=a-very-long-release-name-for-a-platform-x",
                         "--set", "decode.multiNode.enabled=true").returncode == 0  # a LeaderWorkerSet names its pods outright
