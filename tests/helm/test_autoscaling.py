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


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_hpa_without_the_adapter_rules_is_refused(role: str) -> None:
    result = helm_template("--set", f"{role}.autoscaling.enabled=true")
    assert result.returncode != 0
    assert "monitoring.prometheusAdapter.enabled" in result.stderr and f"{role}.autoscaling.keda.enabled" in result.stderr
    # KEDA reads Prometheus itself: no adapter needed.
    assert helm_template("--set", f"{role}.autoscaling.enabled=true", "--set", f"{role}.autoscaling.keda.enabled=true").returncode == 0


@pytest.mark.parametrize("source", ["four-supernodes", "both-hpa"])
def test_every_hpa_metric_has_an_adapter_rule_and_exists(source: str) -> None:
    if source == "four-supernodes":
        docs = render(values=[EXAMPLES / "four-supernodes.yaml"])
    else:
        docs = render("--set", "prefill.autoscaling.enabled=true", "--set", "decode.autoscaling.enabled=true", *ADAPTER_ON)
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpas
    served = {rule["name"]["as"]: rule for rule in _adapter_rules(docs)}
    contract = _contract_names()
    for name, hpa in hpas.items():
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods"
        wanted = metric["pods"]["metric"]["name"]
        assert wanted in served, f"{name} scales on {wanted}, which no adapter rule serves"
        rule = served[wanted]
        assert re.match(rule["name"]["matches"], wanted)
        assert rule["seriesQuery"].startswith(wanted + "{")
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        assert wanted in contract, f"{wanted} is not a metric the services export"


def test_adapter_queries_return_one_value_per_pod(tmp_path: Path) -> None:
    """promtool evaluates each rule's query, filled in as the adapter fills it, on sample series."""
    rules = _adapter_rules(render(*ADAPTER_ON))
    recording, expected = [], []
    series = []
    for i, rule in enumerate(rules):
        metric = rule["name"]["as"]
        record = f"adapter:query_{i}"
        recording.append({"record": record, "expr": _as_promql(
            rule["metricsQuery"], metric, 'namespace="serving",pod=~"p1|p2"', "pod")})
        series += [
            {"series": f'{metric}{{namespace="serving",pod="p1",job="crescent-prefill"}}', "values": "3x5"},
            {"series": f'{metric}{{namespace="serving",pod="p2",job="crescent-prefill"}}', "values": "5x5"},
            {"series": f'{metric}{{namespace="other",pod="p1",job="crescent-prefill"}}', "values": "100x5"},
        ]
        expected.append({"eval_time": "2m", "expr": record, "exp_samples": [
            {"labels": f'{record}{{pod="p1"}}', "value": 3}, {"labels": f'{record}{{pod="p2"}}', "value": 5}]})
    (tmp_path / "adapter.yml").write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": recording}]}))
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": ["adapter.yml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": expected}]}))
    result = run([tool("promtool"), "test", "rules", str(tmp_path / "test.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_keda_queries_name_exported_metrics_and_parse(tmp_path: Path) -> None:
    docs = render("--set", "prefill.autoscaling.enabled=true", "--set", "prefill.autoscaling.keda.enabled=true",
                  "--set", "decode.autoscaling.enabled=true", "--set", "decode.autoscaling.keda.enabled=true")
    queries = [t["metadata"]["query"] for obj in by_kind(docs, "ScaledObject").values() for t in obj["spec"]["triggers"]]
    assert len(queries) == 4
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
