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


def _adapter_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (config_map,) = [d for n, d in by_kind(docs, "ConfigMap").items() if n.endswith("-prometheus-adapter")]
    return yaml.safe_load(config_map["data"]["config.yaml"])["rules"]


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
    assert len(queries) == 2 + 2 + 3  # aggregated: queue, TTFT and KV use
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


def test_aggregated_keda_scales_on_queue_ttft_and_the_groups_kv_use() -> None:
    docs = render("--set", "aggregated.enabled=true", "--set", "aggregated.autoscaling.keda.enabled=true",
                  "--set", "aggregated.autoscaling.kvUsedRatioTarget=0.9", "--set", "prefill.enabled=false",
                  "--set", "decode.enabled=false")
    (obj,) = by_kind(docs, "ScaledObject").values()
    assert obj["spec"]["scaleTargetRef"]["name"] == "crescent-aggregated-g0"
    triggers = {t["metadata"]["query"]: (t["metricType"], t["metadata"]["threshold"]) for t in obj["spec"]["triggers"]}
    pods = 'namespace="serving",pod=~"crescent-aggregated-g0-.*"'
    assert triggers == {
        f"sum(crescent_engine_queue_depth{{{pods}}})": ("AverageValue", "4"),
        'histogram_quantile(0.99, sum by (le) (rate(crescent_gateway_ttft_seconds_bucket{namespace="serving"}[2m])))':
            ("Value", "1.6"),
        f"sum(crescent_engine_kv_used_tokens{{{pods}}}) / clamp_min(sum(crescent_engine_kv_capacity_tokens{{{pods}}}), 1)":
            ("Value", "0.9"),
    }
