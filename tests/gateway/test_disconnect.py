"""A client that goes away frees its decode slot within a second: decode's stream is cancelled and
decode is sent one ``Abort`` (which leaves a tombstone when the request has not arrived yet)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from .fake_tokenizer import MODEL_ID
from .support import FakeBackend, Gateway

ENDLESS = {"model": MODEL_ID, "messages": [{"role": "user", "content": "#loop #delay=0.05 never ending story "}]}


def wait_for_event(backend: FakeBackend, request_id: str, event: str, timeout_s: float = 1.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        events = [e["event"] for e in backend.get("/decode-events") if e["request_id"] == request_id]
        if event in events:
            return events
        assert time.monotonic() < deadline, f"decode did not see {event!r} for {request_id} in {timeout_s} s: {events}"
        time.sleep(0.02)


def last_prefill_id(backend: FakeBackend, before: int) -> str:
    prefills = backend.get("/prefills")
    assert len(prefills) == before + 1
    return prefills[-1]["request_id"]


def cancelled_count(gateway: Gateway) -> float:
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    prefix = 'crescent_gateway_requests_total{status="cancelled"} '
    return sum(float(line[len(prefix):]) for line in metrics.splitlines() if line.startswith(prefix))


def in_flight(gateway: Gateway) -> float:
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    line = next(line for line in metrics.splitlines() if line.startswith("crescent_gateway_requests_in_flight "))
    return float(line.split()[1])


def abort_for(backend: FakeBackend, request_id: str, timeout_s: float = 1.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        aborts = [a for a in backend.get("/aborts") if a["request_id"] == request_id]
        if aborts:
            assert len(aborts) == 1, "one Abort call is enough: decode keeps a tombstone"
            return aborts[0]
        assert time.monotonic() < deadline, f"decode got no Abort for {request_id} in {timeout_s} s"
        time.sleep(0.02)


def test_disconnect_mid_stream_frees_decode_within_a_second(gateway: Gateway, backend: FakeBackend) -> None:
    cancelled_before = cancelled_count(gateway)
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{gateway.url}/v1/chat/completions", json={**ENDLESS, "stream": True}) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            chunks: list[dict[str, Any]] = []
            for line in lines:
                if line.startswith("data: "):
                    chunks.append(json.loads(line[len("data: "):]))
                if len(chunks) == 4:
                    break
            request_id = chunks[0]["id"]
            assert wait_for_event(backend, request_id, "opened") == ["opened"]  # still streaming
        # Leaving the block closes the connection mid-stream.
    closed_at = time.monotonic()
    # Decode's stream ends, and decode is told to drop the request, well within a second.
    assert "cancelled" in wait_for_event(backend, request_id, "cancelled")
    assert abort_for(backend, request_id)["reason"] == "cancelled"
    assert time.monotonic() - closed_at < 1.0
    assert request_id not in backend.get("/jobs")
    # The gateway accounts for it as cancelled, and nothing is left in flight.
    deadline = time.monotonic() + 1.0
    while (cancelled_count(gateway), in_flight(gateway)) != (cancelled_before + 1, 0):
        assert time.monotonic() < deadline, (cancelled_count(gateway), in_flight(gateway))
        time.sleep(0.02)


def hang_up_during_prefill(gateway: Gateway, backend: FakeBackend, directives: str) -> tuple[str, float]:
    """Send a streaming request and hang up before its first token; return its id and when."""
    before = len(backend.get("/prefills"))
    slow_prefill = {**ENDLESS, "stream": True,
                    "messages": [{"role": "user", "content": f"#prefill_delay=0.6 {directives} #loop #delay=0.05 x"}]}
    try:
        # No byte comes back before the first token: the read timeout hangs up during prefill.
        httpx.post(f"{gateway.url}/v1/chat/completions", json=slow_prefill, timeout=httpx.Timeout(5, read=0.3))
        raise AssertionError("the gateway answered before prefill finished")
    except httpx.ReadTimeout:
        pass
    closed_at = time.monotonic()
    request_id = last_prefill_id(backend, before)
    deadline = time.monotonic() + 1.0
    while backend.get("/prefills")[-1]["outcome"] != "cancelled":
        assert time.monotonic() < deadline, backend.get("/prefills")[-1]
        time.sleep(0.02)
    return request_id, closed_at


def released(backend: FakeBackend, request_id: str) -> bool:
    return any(o["released"] for o in backend.get("/outcomes") if o["request_id"] == request_id)


def test_disconnect_during_prefill_cancels_prefill(gateway: Gateway, backend: FakeBackend) -> None:
    request_id, closed_at = hang_up_during_prefill(gateway, backend, "")
    # Decode never had the request: the Abort leaves a tombstone, and the scheduler is told
    # that what it reserved in decode for the request is free again.
    assert abort_for(backend, request_id)["t"] - closed_at < 1.0
    assert wait_for_event(backend, request_id, "tombstone") == ["tombstone"]
    assert released(backend, request_id)
    assert request_id not in backend.get("/jobs")


def test_disconnect_during_prefill_with_handoff_in_flight(gateway: Gateway, backend: FakeBackend) -> None:
    # Prefill's handoff lands in decode 0.3 s after the cancel: decode refuses it (tombstone).
    request_id, _ = hang_up_during_prefill(gateway, backend, "#late_handoff=0.3")
    assert wait_for_event(backend, request_id, "refused", timeout_s=1.5) == ["tombstone", "refused"]
    assert request_id not in backend.get("/jobs")
    assert released(backend, request_id)


def test_disconnect_during_non_streaming_request_cancels_decode(gateway: Gateway, backend: FakeBackend) -> None:
    before = len(backend.get("/prefills"))
    try:
        httpx.post(f"{gateway.url}/v1/chat/completions", json=ENDLESS, timeout=httpx.Timeout(5, read=0.4))
        raise AssertionError("an endless completion returned")
    except httpx.ReadTimeout:
        pass
    closed_at = time.monotonic()
    request_id = last_prefill_id(backend, before)
    assert wait_for_event(backend, request_id, "cancelled")[:2] == ["opened", "cancelled"]
    abort_for(backend, request_id)
    assert time.monotonic() - closed_at < 1.0
    assert request_id not in backend.get("/jobs")
