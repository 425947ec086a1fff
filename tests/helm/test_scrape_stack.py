"""A real Prometheus, loaded with the chart's rules, scrapes a running `crescent up` stack.

After real chat requests, the dashboards' main queries and the recording rules return data:
the metric names, labels and rules agree with what the services actually export.
Contract used: `crescent up --port P --run-dir DIR` writes DIR/services.json, a list of
{"name", "role", "grpc", "metrics_url"} once every service is ready.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from tests.helm.test_observability import DASHBOARDS, dashboard_queries
from tests.helm.tools import NAMESPACE, RELEASE, rules_file, tool
from tests.ports import free_port

pytestmark = pytest.mark.slow
SERVICES = ("gateway", "scheduler", "prefill", "decode", "kvstore")
STARTUP_S = 420

# Queries an operator reads first; each must return a number after real traffic.
MAIN_QUERIES = {
    "request rate": f'sum(rate(crescent_gateway_requests_total{{namespace="{NAMESPACE}"}}[1m]))',
    "ttft p99": f'histogram_quantile(0.99, sum by (le) (rate(crescent_gateway_ttft_seconds_bucket{{namespace="{NAMESPACE}"}}[1m])))',
    "tbt p99": f'histogram_quantile(0.99, sum by (le) (rate(crescent_gateway_tbt_seconds_bucket{{namespace="{NAMESPACE}"}}[1m])))',
    "prompt tokens": f'sum(rate(crescent_gateway_prompt_tokens_total{{namespace="{NAMESPACE}"}}[1m]))',
    "queue depth": f'sum by (role, instance) (crescent_engine_queue_depth{{namespace="{NAMESPACE}"}})',
    "batch size p50": f'histogram_quantile(0.5, sum by (role, le) (rate(crescent_engine_batch_size_bucket{{namespace="{NAMESPACE}"}}[1m])))',
    "kv saturation": f'sum by (role, instance) (crescent_engine_kv_used_tokens{{namespace="{NAMESPACE}"}})'
                     f' / sum by (role, instance) (crescent_engine_kv_capacity_tokens{{namespace="{NAMESPACE}"}})',
    "kvstore tier capacity": f'sum by (tier) (crescent_kvstore_capacity_bytes{{namespace="{NAMESPACE}"}})',
    "instances": f'sum by (role) (crescent_scheduler_instances{{namespace="{NAMESPACE}"}})',
    "ttft p99 rule": f'crescent:gateway_ttft_seconds:quantile_5m{{namespace="{NAMESPACE}",quantile="0.99"}}',
    "ttft slo rule": f'crescent:slo:ttft_seconds{{namespace="{NAMESPACE}"}}',
    "effective capacity rule": f'crescent:effective_requests:ratio_rate5m{{namespace="{NAMESPACE}"}}',
    "in flight": f'sum(crescent_gateway_requests_in_flight{{namespace="{NAMESPACE}"}})',
}


def test_main_queries_are_the_dashboards_own() -> None:
    shipped = {q for path in DASHBOARDS for q in dashboard_queries(path)}
    for name, expr in MAIN_QUERIES.items():
        if name in ("instances", "kvstore tier capacity") or name.endswith(" rule"):
            continue  # reads of gauges and rules the dashboards show through other panels
        as_dashboard = expr.replace("[1m]", "[$__rate_interval]").replace(f'"{NAMESPACE}"', '"$namespace"')
        assert any(as_dashboard in q for q in shipped), name


def _platform_available() -> str | None:
    for module in ["crescent.services.launcher"] + [f"crescent.services.{s}.server" for s in SERVICES]:
        if importlib.util.find_spec(module) is None:
            return f"`crescent up` is not available yet ({module} is missing)"
    return None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[dict]]]:
    """A running `crescent up`: (gateway URL, the services.json entries)."""
    reason = _platform_available()
    if reason:
        pytest.skip(reason)
    run_dir = tmp_path_factory.mktemp("crescent-up")
    port = free_port()
    cmd = [sys.executable, "-m", "crescent.services.cli", "up", "--port", str(port), "--run-dir", str(run_dir),
           "--kv-capacity-tokens", "4096", "--kvstore-gb", "0.25"]
    log = open(run_dir / "up.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    manifest = run_dir / "services.json"
    try:
        deadline = time.monotonic() + STARTUP_S
        while not manifest.exists():
            if proc.poll() is not None:
                pytest.fail(f"crescent up exited with {proc.returncode}:\n{(run_dir / 'up.log').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"crescent up not ready after {STARTUP_S}s; logs in {run_dir}")
            time.sleep(0.5)
        time.sleep(0.2)  # the manifest is written in one call; let it land
        yield f"http://127.0.0.1:{port}", json.loads(manifest.read_text())
    finally:
        _stop(proc)
        log.close()


@pytest.fixture(scope="module")
def prometheus(stack: tuple[str, list[dict]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Prometheus scraping every service each second, with the chart's rules; returns its URL."""
    binary = tool("prometheus")
    _, services = stack
    work = tmp_path_factory.mktemp("prometheus")
    rules = rules_file(work)
    jobs: dict[str, list[str]] = {}
    paths: dict[str, str] = {}
    for service in services:
        url = urlparse(service["metrics_url"])
        # The chart's ServiceMonitors name each job "<release>-<component>"; the rules select on it.
        job = f"{RELEASE}-{service['role']}"
        jobs.setdefault(job, []).append(url.netloc)
        paths[job] = url.path
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": job, "metrics_path": paths[job],
             "static_configs": [{"targets": targets, "labels": {"namespace": NAMESPACE}}]}
            for job, targets in jobs.items()
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited:\n{(work / 'prometheus.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("prometheus not ready after 60s")
            time.sleep(0.3)
        yield url
    finally:
        _stop(proc)
        log.close()


def _query(prometheus: str, expr: str) -> list[dict]:
    reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def _chat(gateway: str, content: str, stream: bool) -> None:
    models = httpx.get(f"{gateway}/v1/models", timeout=30).json()["data"]
    body = {"model": models[0]["id"], "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, "stream": stream}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        reply.read()


def test_prometheus_scrapes_the_stack_and_dashboards_get_data(stack: tuple[str, list[dict]], prometheus: str) -> None:
    gateway, services = stack
    assert {s["role"] for s in services} == set(SERVICES)
    # Every target is up before the traffic, so counters are seen going up rather than appearing.
    deadline = time.monotonic() + 30
    while True:
        up = _query(prometheus, f'up{{namespace="{NAMESPACE}"}}')
        if len(up) == len(services) and all(r["value"][1] == "1" for r in up):
            break
        assert time.monotonic() < deadline, f"targets not all up: {up}"
        time.sleep(0.5)
    prompt = "Name three colours of the rainbow, briefly. " * 8
    _chat(gateway, prompt, stream=True)
    time.sleep(3)
    for i in range(3):
        _chat(gateway, prompt, stream=True)  # the same prompt again: a prefix-cache hit
        _chat(gateway, f"Count to {i + 3}.", stream=i % 2 == 0)
    time.sleep(4)  # a few scrapes and rule evaluations

    empty = {}
    for name, expr in MAIN_QUERIES.items():
        result = _query(prometheus, expr)
        values = [float(r["value"][1]) for r in result]
        if not values or any(math.isnan(v) for v in values):
            empty[name] = result
    assert not empty, f"dashboard queries without data: {empty}"
    roles = {r["metric"]["role"]: float(r["value"][1]) for r in _query(prometheus, MAIN_QUERIES["instances"])}
    assert roles.get("prefill", 0) >= 1 and roles.get("decode", 0) >= 1
    ok = _query(prometheus, f'crescent_gateway_requests_total{{namespace="{NAMESPACE}",status="ok"}}')
    assert ok and float(ok[0]["value"][1]) >= 7
