"""The gateway's door under attack (issue 31, findings 6 and 7), on real gateway processes
against the fake engines: headers that never end, guessed keys, grammars that take seconds to
compile, and refusals that would each cost a ledger row."""

from __future__ import annotations

import socket
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from crescent.protos.common_pb2 import Constraint
from crescent.services.model.grammar import ConstraintError, check_constraint
from tests.gateway.support import FakeBackend, Gateway

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)

ADMIN_KEY = "admin-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    fake = FakeBackend()
    fake.start_backend()
    yield fake
    fake.stop()


def started(gw: Gateway) -> Gateway:
    """``gw`` once it answers /health."""
    gw.start_gateway()
    return gw


@pytest.fixture
def gateway_with(backend: FakeBackend, tmp_path: Path) -> Iterator[Any]:
    made: list[Gateway] = []

    def make(listen: dict[str, Any] | None = None, **settings: Any) -> Gateway:
        auth = {"enabled": True, "admin_key": ADMIN_KEY, **settings.pop("auth", {})}
        gw = Gateway(tmp_path, backend.address, auth=auth, **settings)
        config_path = Path(gw.argv[-1])
        config = yaml.safe_load(config_path.read_text())
        config["listen"].update(listen or {})  # the port the fixture chose stays
        config_path.write_text(yaml.safe_dump(config))
        made.append(gw)
        return started(gw)

    yield make
    for gw in made:
        assert gw.stop() == 0


def admin(gw: Gateway, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(method, f"{gw.url}/admin{path}", json=body, timeout=10,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})


def new_key(gw: Gateway, **limits: Any) -> str:
    created = admin(gw, "POST", "/keys", {"tenant": f"t{uuid.uuid4().hex[:8]}", "create_tenant": True})
    assert created.status_code == 201, created.text
    if limits:
        reply = admin(gw, "PUT", f"/keys/{created.json()['id']}/limits", limits)
        assert reply.status_code == 200, reply.text
    return created.json()["key"]


def chat(gw: Gateway, key: str, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})},
                      json={"model": "fake-model", "messages": [{"role": "user", "content": "hello"}],
                            "max_tokens": 2, **extra})


def metric(gw: Gateway, name: str, **labels: str) -> float:
    text = httpx.get(f"{gw.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


# -- headers that never end ------------------------------------------------------------------------

def test_connections_whose_headers_never_end_are_closed(gateway_with: Any) -> None:
    """Finding 6: 300 of 300 dribbling connections stayed open after 45 s. Now each gets 408 and
    is closed once its headers are late, and the gateway serves the whole time."""
    gw = gateway_with(listen={"header_timeout_s": 1.5})
    dribblers = []
    for _ in range(40):
        s = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        dribblers.append(s)
    silent = socket.create_connection(("127.0.0.1", gw.port), timeout=10)  # connects, never sends a byte
    ended_at = time.monotonic() + 6.0
    answers: dict[int, bytes] = {}
    while time.monotonic() < ended_at and len(answers) < len(dribblers):
        for i, s in enumerate(dribblers):
            if i in answers:
                continue
            try:
                s.sendall(b"X-Slow: 1\r\n")  # a header line every 0.25 s: the keep-alive timer never fires
            except OSError:
                answers[i] = b"reset"
        time.sleep(0.25)
        assert httpx.get(f"{gw.url}/health", timeout=5).status_code == 200, "the gateway keeps serving"
        for i, s in enumerate(dribblers):
            if i not in answers:
                s.setblocking(False)
                try:
                    data = s.recv(4096)
                    answers[i] = data or b"closed"
                except BlockingIOError:
                    pass
                except OSError:
                    answers[i] = b"reset"
                s.setblocking(True)
    assert len(answers) == len(dribblers), f"{len(dribblers) - len(answers)} dribbling connections still open"
    assert sum(a.startswith(b"HTTP/1.1 408") for a in answers.values()) >= len(dribblers) - 2, answers
    silent.settimeout(3)
    assert silent.recv(4096).startswith(b"HTTP/1.1 408")
    assert metric(gw, "crescent_gateway_header_timeouts_total") >= len(dribblers)
    for s in [*dribblers, silent]:
        s.close()


def test_slow_but_steady_requests_and_kept_alive_connections_are_served(gateway_with: Any) -> None:
    gw = gateway_with(listen={"header_timeout_s": 1.5})
    key = new_key(gw)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        request = (f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n\r\n").encode()
        for part in (request[:20], request[20:40], request[40:]):  # headers in three pieces, inside the deadline
            s.sendall(part)
            time.sleep(0.3)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(1.0)  # idle between requests: the deadline starts with the next request's first byte
        s.sendall(request)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")


# -- guessed keys ------------------------------------------------------------------------------------

def test_a_source_guessing_keys_is_throttled_and_its_known_users_are_not(gateway_with: Any) -> None:
    """Finding 6: 401s were not throttled. Now a source's invalid keys beyond the burst get 429
    too_many_failed_auth (no database read), a key that worked from there still works, and
    X-Forwarded-For counts only from a trusted proxy."""
    gw = gateway_with(auth={"failed_auth_burst": 5, "failed_auth_per_minute": 60},
                      listen={"forwarded_allow_ips": []})
    good = new_key(gw)
    assert chat(gw, good).status_code == 200
    codes = [chat(gw, "crs-" + uuid.uuid4().hex).status_code for _ in range(5)]
    assert codes == [401] * 5
    throttled = chat(gw, "crs-" + uuid.uuid4().hex, headers={"X-Forwarded-For": "203.0.113.9"})
    assert throttled.status_code == 429, throttled.text
    assert throttled.json()["error"]["code"] == "too_many_failed_auth"
    assert 1 <= int(throttled.headers["retry-after"]) <= 2  # one try back per second
    assert chat(gw, good).status_code == 200, "a key that worked from this address still does"
    assert admin(gw, "GET", "/tenants").status_code == 200, "so does the admin key"
    wrong_admin = httpx.get(f"{gw.url}/admin/tenants", headers={"Authorization": "Bearer not-the-admin"}, timeout=10)
    assert wrong_admin.status_code == 429, "guessing the admin key is throttled too"
    assert metric(gw, "crescent_gateway_auth_throttled_total") >= 2
    time.sleep(1.2)
    assert chat(gw, "crs-" + uuid.uuid4().hex).status_code == 401, "the bucket refills"


def test_behind_a_trusted_proxy_each_client_has_its_own_bucket(gateway_with: Any) -> None:
    gw = gateway_with(auth={"failed_auth_burst": 3, "failed_auth_per_minute": 1},
                      listen={"forwarded_allow_ips": ["127.0.0.1"]})
    guesser = {"X-Forwarded-For": "198.51.100.7"}
    assert [chat(gw, "crs-" + uuid.uuid4().hex, guesser).status_code for _ in range(4)] == [401, 401, 401, 429]
    other = {"X-Forwarded-For": "198.51.100.8"}
    assert chat(gw, "crs-" + uuid.uuid4().hex, other).status_code == 401, "another client behind the proxy"
    key = new_key(gw)
    assert chat(gw, key, other).status_code == 200


# -- grammars ----------------------------------------------------------------------------------------

def _slow_regex() -> str:
    return "(" + "|".join(f"word{i}abc" for i in range(400_000)) + ")"  # 5.5 MB: seconds to compile


def _compile_seconds(regex: str) -> float:
    start = time.perf_counter()
    with pytest.raises(ConstraintError):
        check_constraint(Constraint(regex=regex))
    return time.perf_counter() - start


def test_grammars_compile_off_the_event_loop_and_only_once_admitted(gateway_with: Any) -> None:
    """Finding 6: a 6 MB regex from a key already over its limit stalled /health 4.65 s (compiled
    on the event loop before rate limiting). Now an over-limit key gets its 429 without a compile,
    and a compile in progress leaves /health answering."""
    regex = _slow_regex()
    compile_s = _compile_seconds(regex)
    gw = gateway_with(max_constraint_bytes=8_000_000, max_body_bytes=16_000_000)
    limited = new_key(gw, rpm=1)
    assert chat(gw, limited).status_code == 200  # its one request this minute
    start = time.perf_counter()
    refused = chat(gw, limited, structured_outputs={"regex": regex})
    refused_s = time.perf_counter() - start
    assert refused.status_code == 429, refused.text
    assert refused_s < compile_s / 2, f"refused in {refused_s:.2f} s; a compile takes {compile_s:.2f} s"

    key = new_key(gw)
    result: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: result.setdefault("r", chat(gw, key, structured_outputs={"regex": regex})))
    health_s = []
    sender.start()
    while sender.is_alive():
        start = time.perf_counter()
        assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200
        health_s.append(time.perf_counter() - start)
        time.sleep(0.05)
    sender.join()
    assert result["r"].status_code == 400 and result["r"].json()["error"]["code"] == "unsupported_constraint"
    print(f"compile {compile_s:.2f} s; /health during it: median {statistics.median(health_s) * 1000:.0f} ms, "
          f"max {max(health_s) * 1000:.0f} ms over {len(health_s)}")
    assert max(health_s) < max(0.5, compile_s / 3), health_s


def test_a_constraint_over_the_size_limit_is_refused_before_it_compiles(gateway_with: Any) -> None:
    gw = gateway_with()  # max_constraint_bytes: 256 KiB
    key = new_key(gw)
    start = time.perf_counter()
    reply = chat(gw, key, structured_outputs={"regex": _slow_regex()})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "constraint_too_large", reply.text
    assert reply.json()["error"]["param"] == "structured_outputs"
    assert time.perf_counter() - start < 1.5
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    ok = chat(gw, key, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert ok.status_code == 200, ok.text


# -- refusals and the ledger -------------------------------------------------------------------------

def test_refused_requests_are_counted_not_written_to_the_ledger(gateway_with: Any) -> None:
    """Finding 7: every 429 wrote a ledger row, so limits did not bound ledger writes."""
    gw = gateway_with()
    key = new_key(gw, rpm=2)
    replies = [chat(gw, key).status_code for _ in range(30)]
    assert replies.count(200) == 2 and replies.count(429) == 28, replies
    invalid = chat(gw, new_key(gw), structured_outputs={"regex": "(unclosed"})  # a 400 once admitted: nothing used
    assert invalid.status_code == 400 and invalid.json()["error"]["code"] == "unsupported_constraint", invalid.text
    rows = admin(gw, "GET", "/usage?group_by=status")
    assert rows.status_code == 200, rows.text
    statuses = {r["status"]: int(r["requests"]) for r in rows.json()["data"]}
    assert statuses == {"ok": 2}, statuses
    assert metric(gw, "crescent_gateway_refused_requests_total", status="rejected") == 28
    assert metric(gw, "crescent_gateway_refused_requests_total", status="client_error") == 1
