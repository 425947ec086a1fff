"""Bad requests get OpenAI-style errors with the right status, and the gateway keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from crescent.services.common.settings import SettingsError
from crescent.services.gateway.config import load_gateway_settings

from .fake_tokenizer import MODEL_ID
from .in_process import InProcessGateway
from .support import FakeBackend, Gateway, free_port

GOOD = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}


def body(**changes: Any) -> dict[str, Any]:
    return {**GOOD, **changes}


def without(key: str) -> dict[str, Any]:
    return {k: v for k, v in GOOD.items() if k != key}


def user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


# (case id, request body or raw bytes, status, error code, param)
BAD_REQUESTS = [
    ("malformed json", b'{"model": "fake-model", "messages": [', 400, "invalid_json", None),
    ("body not an object", [1, 2], 400, "invalid_body", None),
    ("max_tokens string", body(max_tokens="5"), 400, "invalid_value", "max_tokens"),
    ("max_tokens float", body(max_tokens=5.5), 400, "invalid_value", "max_tokens"),
    ("temperature string", body(temperature="hot"), 400, "invalid_value", "temperature"),
    ("temperature too high", body(temperature=3.0), 400, "invalid_value", "temperature"),
    ("stream string", body(stream="yes"), 400, "invalid_value", "stream"),
    ("messages string", body(messages="hi"), 400, "invalid_value", "messages"),
    ("model missing", without("model"), 400, "invalid_value", "model"),
    ("model number", body(model=7), 400, "invalid_value", "model"),
    ("unknown model", body(model="gpt-4o"), 404, "model_not_found", "model"),
    ("messages missing", without("messages"), 400, "invalid_value", "messages"),
    ("messages empty", body(messages=[]), 400, "invalid_value", "messages"),
    ("message not an object", body(messages=["hi"]), 400, "invalid_value", "messages[0]"),
    ("role missing", body(messages=[{"content": "hi"}]), 400, "invalid_value", "messages[0].role"),
    ("role unknown", body(messages=[{"role": "robot", "content": "hi"}]), 400, "invalid_value", "messages[0].role"),
    ("content missing", body(messages=[{"role": "user"}]), 400, "invalid_value", "messages[0].content"),
    ("content number", body(messages=user(42)), 400, "invalid_value", "messages[0].content"),
    ("content image part", body(messages=user([{"type": "image_url", "image_url": {"url": "x"}}])), 400,
     "unsupported_parameter", "messages[0].content"),
    ("message extra field", body(messages=[{"role": "user", "content": "hi", "tool_calls": []}]), 400,
     "unsupported_parameter", "messages[0].tool_calls"),
    ("system not first", body(messages=[*user("hi"), {"role": "system", "content": "late"}]), 400, None, "messages"),
    ("max_tokens zero", body(max_tokens=0), 400, "invalid_value", "max_tokens"),
    ("max_tokens negative", body(max_tokens=-3), 400, "invalid_value", "max_tokens"),
    ("max_completion_tokens zero", body(max_completion_tokens=0), 400, "invalid_value", "max_completion_tokens"),
    ("prompt beyond context", body(messages=user("x" * 600)), 400, "context_length_exceeded", "messages"),
    ("prompt + max_tokens beyond context", body(max_tokens=250), 400, "context_length_exceeded", "max_tokens"),
    ("tools", body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "unsupported_parameter", "tools"),
    ("n above 16", body(n=17), 400, "invalid_value", "n"),
    ("top_logprobs without logprobs", body(top_logprobs=2), 400, "unsupported_parameter", "top_logprobs"),
    ("presence_penalty beyond 2", body(presence_penalty=2.5), 400, "invalid_value", "presence_penalty"),
    ("response_format unknown type", body(response_format={"type": "yaml"}), 400, "invalid_value",
     "response_format.type"),
    ("five stop strings", body(stop=["a", "b", "c", "d", "e"]), 400, "invalid_value", "stop"),
    ("empty stop string", body(stop=""), 400, "invalid_value", "stop"),
    ("stream_options unknown", body(stream=True, stream_options={"continuous": True}), 400,
     "unsupported_parameter", "stream_options.continuous"),
]


def assert_still_serving(url: str) -> None:
    reply = httpx.post(f"{url}/v1/chat/completions", json=GOOD, timeout=10)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "hi"


def assert_error(reply: httpx.Response, status: int, code: str | None, param: str | None) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status in (400, 404) else error["type"])
    assert error["code"] == code
    assert error["param"] == param
    return error


@pytest.mark.parametrize(("payload", "status", "code", "param"), [c[1:] for c in BAD_REQUESTS],
                         ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(gateway: Gateway, payload: Any, status: int, code: str | None, param: str | None) -> None:
    url = f"{gateway.url}/v1/chat/completions"
    if isinstance(payload, bytes):
        reply = httpx.post(url, content=payload, headers={"content-type": "application/json"}, timeout=10)
    else:
        reply = httpx.post(url, json=payload, timeout=10)
    assert_error(reply, status, code, param)
    assert_still_serving(gateway.url)


def test_context_error_names_the_limit(gateway: Gateway) -> None:
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=body(max_tokens=250), timeout=10)
    assert "256" in assert_error(reply, 400, "context_length_exceeded", "max_tokens")["message"]


def test_unknown_route_is_a_json_404(gateway: Gateway) -> None:
    reply = httpx.get(f"{gateway.url}/v1/nothing-here", timeout=5)
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_scheduler_rejection_is_429_with_retry_after(gateway: Gateway, backend: FakeBackend, stream: bool) -> None:
    backend.post("/reject", {"reason": "ttft_slo", "message": "predicted TTFT 40 s > 30 s", "retry_after_s": 7.2})
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=body(stream=stream), timeout=10)
    error = assert_error(reply, 429, "rate_limit_exceeded", None)
    assert error["type"] == "rate_limit_error"
    assert "ttft_slo" in error["message"]
    assert reply.headers["retry-after"] == "8"  # whole seconds, rounded up
    assert_still_serving(gateway.url)


def test_a_request_larger_than_any_decode_cache_is_400_not_429(gateway: Gateway, backend: FakeBackend) -> None:
    # Retrying cannot help: the client has to ask for fewer tokens.
    backend.post("/reject", {"reason": "exceeds_kv_capacity", "retry_after_s": 0,
                             "message": "the request needs 9000 tokens of decode KV; the largest decode instance holds 4096"})
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=GOOD, timeout=10)
    error = assert_error(reply, 400, "exceeds_kv_capacity", None)
    assert "4096" in error["message"] and "retry-after" not in reply.headers
    assert_still_serving(gateway.url)


def test_no_instance_rejection_is_503(gateway: Gateway, backend: FakeBackend) -> None:
    backend.post("/reject", {"reason": "no_decode_instance", "message": "no decode instance", "retry_after_s": 0})
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=GOOD, timeout=10)
    assert_error(reply, 503, "backend_unavailable", None)
    assert reply.headers["retry-after"] == "1"
    assert_still_serving(gateway.url)


@pytest.fixture(scope="module")
def orphan_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway whose scheduler address has nothing listening."""
    gw = InProcessGateway(tmp_path_factory.mktemp("orphan"), f"127.0.0.1:{free_port()}", place_timeout_s=2)
    gw.start_gateway(healthy=False)
    yield gw
    assert gw.stop() == 0


def test_unreachable_scheduler(orphan_gateway: Gateway) -> None:
    # The gateway stays in its Service (200) and answers each request 503 + Retry-After itself.
    health = httpx.get(f"{orphan_gateway.url}/health", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "unavailable"
    assert "scheduler" in health.json()["reason"]
    for stream in (False, True):
        reply = httpx.post(f"{orphan_gateway.url}/v1/chat/completions", json=body(stream=stream), timeout=10)
        error = assert_error(reply, 503, "backend_unavailable", None)
        assert "scheduler" in error["message"]
        assert reply.headers["retry-after"] == "1"
    # Client errors are still reported as such without a backend.
    reply = httpx.post(f"{orphan_gateway.url}/v1/chat/completions", json=body(model="x"), timeout=10)
    assert_error(reply, 404, "model_not_found", "model")


def test_bad_config_names_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("block_size: 0\nschedular_address: x\n")
    monkeypatch.setenv("CRESCENT_GATEWAY__LISTEN__PORT", "not-a-port")
    with pytest.raises(SettingsError) as failed:
        load_gateway_settings(config)
    message = str(failed.value)
    assert "block_size" in message and "schedular_address" in message
    assert "CRESCENT_GATEWAY__LISTEN__PORT" in message
