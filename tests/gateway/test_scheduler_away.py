"""A scheduler restart does not take the gateway out of its Service: /health stays 200 (its body
says the backend is away), each request meanwhile gets 503 + Retry-After, and serving resumes
when the scheduler is back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .fake_tokenizer import MODEL_ID
from .in_process import InProcessBackend, InProcessGateway
from .support import FakeBackend

HELLO = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
def own_backend() -> Iterator[FakeBackend]:
    fake = InProcessBackend()
    fake.start_backend()
    yield fake
    fake.stop()


def test_scheduler_restart_keeps_the_gateway_in_service(own_backend: FakeBackend, tmp_path: Path) -> None:
    gw = InProcessGateway(tmp_path, own_backend.address, place_timeout_s=1)
    gw.start_gateway()
    try:
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=HELLO, timeout=10).status_code == 200
        assert own_backend.stop() == 0  # the scheduler (with prefill and decode) goes away

        health = httpx.get(f"{gw.url}/health", timeout=5)
        assert health.status_code == 200
        assert health.json()["status"] == "unavailable" and "scheduler" in health.json()["reason"]
        for stream in (False, True):
            reply = httpx.post(f"{gw.url}/v1/chat/completions", json={**HELLO, "stream": stream}, timeout=10)
            assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
            assert reply.json()["error"]["code"] == "backend_unavailable"

        own_backend.start_backend()  # back on the same address
        back = time.monotonic()
        while httpx.get(f"{gw.url}/health", timeout=5).json()["status"] != "ok":
            assert time.monotonic() - back < 2.0, "the gateway did not reconnect within 2 s"
            time.sleep(0.05)
        reply = httpx.post(f"{gw.url}/v1/chat/completions", json=HELLO, timeout=10)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "hello"
    finally:
        assert gw.stop() == 0
