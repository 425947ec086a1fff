"""/health says whether the gateway takes requests (and reports the backend's state); /metrics
reports what the requests did."""

from __future__ import annotations

import re

import httpx
import openai

from .support import FakeBackend, Gateway


def metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.compile(rf"^{re.escape(name + labels)} (\S+)$", re.M)
    found = pattern.search(text)
    assert found, f"{name}{labels} not in /metrics"
    return float(found.group(1))


def test_health_reports_the_backend_without_leaving_the_service(gateway: Gateway, backend: FakeBackend) -> None:
    ready = httpx.get(f"{gateway.url}/health", timeout=5)
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok", "model": "fake-model", "prefill_instances": 1, "decode_instances": 1}
    try:
        for prefill, decode in ((1, 0), (0, 1)):
            backend.put("/instances", {"prefill": prefill, "decode": decode})
            starting = httpx.get(f"{gateway.url}/health", timeout=5)
            # Still taking requests (they get 503 + Retry-After while nothing can serve them).
            assert starting.status_code == 200
            assert starting.json()["status"] == "starting"
            assert (starting.json()["prefill_instances"], starting.json()["decode_instances"]) == (prefill, decode)
    finally:
        backend.put("/instances", {"prefill": 1, "decode": 1})
    assert httpx.get(f"{gateway.url}/health", timeout=5).status_code == 200


def test_metrics_count_tokens_and_latency(gateway: Gateway, client: openai.OpenAI, model: str) -> None:
    before = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    message = [{"role": "user", "content": "#delay=0.01 count these tokens please"}]
    first = client.chat.completions.create(model=model, messages=message)
    second = client.chat.completions.create(model=model, messages=message)
    after = httpx.get(f"{gateway.url}/metrics", timeout=5).text

    def grew(name: str, labels: str = "") -> float:
        return metric(after, name, labels) - metric(before, name, labels)

    assert grew("crescent_gateway_requests_total", '{status="ok"}') == 2
    assert grew("crescent_gateway_prompt_tokens_total") == first.usage.prompt_tokens + second.usage.prompt_tokens
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, second)]
    assert grew("crescent_gateway_cached_tokens_total") == sum(cached) and cached[1] > cached[0]
    assert grew("crescent_gateway_completion_tokens_total") == first.usage.completion_tokens * 2
    assert grew("crescent_gateway_ttft_seconds_count") == 2
    assert grew("crescent_gateway_e2e_seconds_count") == 2
    assert grew("crescent_gateway_tbt_seconds_count") == 2
    # Every token after the first is one interval; decode paced them 10 ms apart.
    assert grew("crescent_gateway_inter_token_seconds_count") == 2 * (first.usage.completion_tokens - 1)
    assert grew("crescent_gateway_tbt_seconds_sum") >= 2 * 0.01
    assert metric(after, "crescent_gateway_requests_in_flight") == 0


def test_client_errors_are_counted(gateway: Gateway, model: str) -> None:
    def client_errors() -> float:
        return metric(httpx.get(f"{gateway.url}/metrics", timeout=5).text, "crescent_gateway_requests_total",
                      '{status="client_error"}')

    httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": model, "messages": []}, timeout=5)
    before = client_errors()
    httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": model, "messages": []}, timeout=5)
    unknown_model = {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    httpx.post(f"{gateway.url}/v1/chat/completions", json=unknown_model, timeout=5)
    assert client_errors() == before + 2
