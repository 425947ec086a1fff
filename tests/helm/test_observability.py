"""Prometheus rules and Grafana dashboards: promtool checks, unit tests, generated JSON."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.tools import CHART, REPO, rules_file, run, tool

RULE_TESTS = Path(__file__).with_name("rules_test.yml")
METRICS_CONTRACT = REPO / "services" / "common" / "metrics.py"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))


def _contract_names() -> set[str]:
    return set(re.findall(r'"(crescent_[a-z0-9_]+)"', METRICS_CONTRACT.read_text()))


def _base_name(series: str) -> str:
    return re.sub(r"_(total|bucket|sum|count)$", "", series)


def dashboard_queries(path: Path) -> list[str]:
    def panels(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for panel in items:
            out.append(panel)
            out.extend(panels(panel.get("panels", [])))
        return out

    dashboard = json.loads(path.read_text())
    return [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", []) if t.get("expr")]


def as_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables filled in, as Prometheus would receive it."""
    return expr.replace("$__rate_interval", "1m").replace("$namespace", "serving")


def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    result = run([tool("promtool"), "check", "rules", str(rules_file(tmp_path))])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rule_unit_tests_pass(tmp_path: Path) -> None:
    rules_file(tmp_path)
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    result = run([tool("promtool"), "test", "rules", str(tmp_path / RULE_TESTS.name)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_that_fires_it(tmp_path: Path) -> None:
    groups = yaml.safe_load(rules_file(tmp_path).read_text())["groups"]
    alerts = {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    assert len(alerts) >= 10
    assert alerts == tested, f"alerts without a firing unit test: {sorted(alerts - tested)}"


def test_rules_follow_the_slo_values(tmp_path: Path) -> None:
    path = rules_file(tmp_path, "--set", "slo.ttftSeconds=5", "--set-json", "slo.tbtSeconds=0.05",
                      "--set-json", "slo.objective=0.999")
    text = "\n".join(rule["expr"] for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"])
    assert 'crescent_gateway_ttft_seconds_bucket{namespace="serving",job="crescent-gateway",le="5.0"}' in text
    assert 'le="0.05"' in text
    # The fast burn threshold is 14.4x the 0.1% budget.
    assert "> 0.0144" in text


def test_rules_and_dashboards_query_only_contract_metrics(tmp_path: Path) -> None:
    contract = _contract_names()
    assert "crescent_gateway_ttft_seconds" in contract
    texts = [rules_file(tmp_path).read_text()] + [p.read_text() for p in DASHBOARDS]
    used = {_base_name(name) for text in texts for name in re.findall(r"\bcrescent_[a-z0-9_]+", text)}
    assert used - contract == set()


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    # promtool parses every expression of a rules file; wrap each query as a recording rule.
    queries = [as_promql(q) for path in DASHBOARDS for q in dashboard_queries(path)]
    assert len(queries) > 30
    rules = [{"record": f"dashboard:query_{i}", "expr": q} for i, q in enumerate(queries)]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = run([tool("promtool"), "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboards_cover_what_operators_look_for() -> None:
    titles = {json.loads(p.read_text())["title"]: p for p in DASHBOARDS}
    assert sorted(titles) == ["Crescent / KV cache", "Crescent / Overview", "Crescent / Pools"]
    overview = " ".join(dashboard_queries(titles["Crescent / Overview"]))
    for needle in ("crescent_gateway_ttft_seconds_bucket", "crescent_gateway_tbt_seconds_bucket",
                   "crescent:slo:ttft_seconds", "crescent:effective_requests:ratio_rate5m",
                   "crescent_scheduler_rejections_total"):
        assert needle in overview
    cache = " ".join(dashboard_queries(titles["Crescent / KV cache"]))
    for needle in ("crescent_gateway_cached_tokens_total", "crescent_kvstore_bytes", "crescent_kvstore_evictions_total",
                   "crescent_engine_kv_transfer_bytes_total", "crescent_gateway_spend_usd_total",
                   "crescent_gateway_cache_savings_usd_total"):
        assert needle in cache
    pools = " ".join(dashboard_queries(titles["Crescent / Pools"]))
    for needle in ("crescent_engine_queue_depth", "crescent_engine_batch_size_bucket", "crescent_engine_kv_used_tokens"):
        assert needle in pools


@pytest.mark.parametrize("generator", ["helm/dashboards/generate.py", "helm/schema/generate.py"])
@pytest.mark.slow
def test_committed_files_equal_the_generators_output(generator: str) -> None:
    if generator.startswith("helm/dashboards"):
        pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk is not installed (run scripts/install_tools.sh)")
    result = run([sys.executable, str(REPO / generator), "--check"], cwd=REPO)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_generator_check_notices_a_stale_dashboard(tmp_path: Path) -> None:
    pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk is not installed (run scripts/install_tools.sh)")
    for path in DASHBOARDS:
        shutil.copy(path, tmp_path / path.name)
    stale = tmp_path / "pools.json"
    stale.write_text(stale.read_text().replace("Queue depth", "Queue length"))
    result = run([sys.executable, str(REPO / "helm/dashboards/generate.py"), "--check", "--out", str(tmp_path)])
    assert result.returncode == 1 and "pools.json" in result.stderr
