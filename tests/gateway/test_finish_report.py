"""The scheduler learns a request finished before its client does: a client that sends its next
request as soon as the last one ended must not be refused for KV the finished one still held
(the scheduler frees decode's reservation when the gateway's finish report arrives)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from crescent.services.gateway.attempts.attempt import FINISH_REPORT_WAIT_S

from .fake_tokenizer import MODEL_ID
from .support import FakeBackend, Gateway


@pytest.fixture
def slow_scheduler(backend: FakeBackend) -> Iterator[FakeBackend]:
    """ReportOutcome takes ``seconds`` before the fake scheduler has it (reset afterwards)."""
    yield backend
    backend.put("/outcome-delay", {"seconds": 0.0})


def finish_report(backend: FakeBackend, request_id: str) -> dict[str, Any] | None:
    return next((o for o in backend.get("/outcomes") if o["request_id"] == request_id
                 and (o["finished"] or o["released"])), None)


def stream_to_the_end(gateway: Gateway, content: str, max_tokens: int) -> tuple[str, float]:
    """A streamed chat read to its last chunk; returns its id and when the client had that chunk."""
    body = {"model": MODEL_ID, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}]}
    with httpx.Client(timeout=10) as http, http.stream("POST", f"{gateway.url}/v1/chat/completions",
                                                       json=body) as reply:
        assert reply.status_code == 200
        request_id, finished_at = "", 0.0
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                request_id = chunk["id"]
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    finished_at = time.monotonic()
                    break
    assert finished_at, "the stream ended without a finish reason"
    return request_id, finished_at


@pytest.mark.parametrize("max_tokens", [8, 1], ids=["finished-at-decode", "finished-at-its-first-token"])
def test_the_scheduler_has_the_finish_before_the_client_has_the_last_token(
        gateway: Gateway, slow_scheduler: FakeBackend, max_tokens: int) -> None:
    slow_scheduler.put("/outcome-delay", {"seconds": 0.2})
    request_id, client_done = stream_to_the_end(gateway, "#loop one two three", max_tokens)
    report = finish_report(slow_scheduler, request_id)
    assert report is not None, "the client had its last token before the scheduler had the finish report"
    assert report["t"] <= client_done


def test_a_scheduler_too_slow_to_answer_delays_the_last_token_by_a_bounded_wait(
        gateway: Gateway, slow_scheduler: FakeBackend) -> None:
    slow_scheduler.put("/outcome-delay", {"seconds": 1.5})  # within the report call's own timeout
    started = time.monotonic()
    request_id, client_done = stream_to_the_end(gateway, "#loop one two three", 8)
    assert client_done - started < FINISH_REPORT_WAIT_S + 1.5
    deadline = time.monotonic() + 5
    while finish_report(slow_scheduler, request_id) is None:  # it still arrives, in the background
        assert time.monotonic() < deadline, "the finish report never reached the scheduler"
        time.sleep(0.05)
