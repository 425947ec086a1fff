"""Rate limits and budgets on real processes: two gateways sharing one real redis-server (and one
tenants database), against the fake engines. Short periods (``limits.period_s``) keep it fast:
a limit of N per minute is N per ``PERIOD_S`` here."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.tenancy.redis_server import RedisServer, redis_server

from .support import FakeBackend, Gateway

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)

ADMIN_KEY = "admin-" + uuid.uuid4().hex
PERIOD_S = 2.0
LEASE_S = 1.0
RESET = re.compile(r"^(\d+ms|(\d+h)?(\d+m)?\d+(\.\d+)?s)$")  # OpenAI's: 20ms, 1.5s, 6m0s


def limited_gateway(root: Path, backend: FakeBackend, database: str, store: str, **limits: Any) -> Gateway:
    return Gateway(root, backend.address,
                   auth={"enabled": True, "admin_key": ADMIN_KEY, "key_cache_s": 0.5, "database_url": database},
                   limits={"store": store, "period_s": PERIOD_S, "lease_s": LEASE_S, **limits})


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture(scope="module")
def pair(backend: FakeBackend, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Gateway]]:
    """Two gateway replicas: one Redis, one database."""
    root = tmp_path_factory.mktemp("limits")
    database = f"sqlite:///{root}/tenancy.sqlite3"
    gateways = [limited_gateway(root, backend, database, redis.url) for _ in range(2)]
    gateways[0].start_gateway()  # the first migrates the database alone
    gateways[1].start_gateway()
    yield gateways
    for gw in gateways:
        assert gw.stop() == 0


def admin(gw: Gateway, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(method, f"{gw.url}/admin{path}", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                         timeout=10)


def new_key(gw: Gateway, tenant: str | None = None, **limits: Any) -> dict[str, Any]:
    created = admin(gw, "POST", "/keys", {"tenant": tenant or f"t{uuid.uuid4().hex[:8]}", "create_tenant": True})
    assert created.status_code == 201, created.text
    key = created.json()
    if limits:
        reply = admin(gw, "PUT", f"/keys/{key['id']}/limits", limits)
        assert reply.status_code == 200, reply.text
    return key


def chat(gw: Gateway, key: str, content: str = "hello there", max_tokens: int = 2, **extra: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=10, json={
        "model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra})


def assert_limit_headers(reply: httpx.Response, *kinds: str) -> None:
    for kind in kinds:
        assert int(reply.headers[f"x-ratelimit-limit-{kind}"]) >= 1
        assert int(reply.headers[f"x-ratelimit-remaining-{kind}"]) >= 0
        assert RESET.match(reply.headers[f"x-ratelimit-reset-{kind}"]), reply.headers[f"x-ratelimit-reset-{kind}"]


def assert_refused(reply: httpx.Response, type_: str, code: str = "rate_limit_exceeded") -> dict[str, Any]:
    assert reply.status_code == 429, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["code"]) == (type_, code)
    assert int(reply.headers["retry-after"]) >= 1
    return error


def hammer(gateways: list[Gateway], key: str, seconds: float, threads: int = 4,
           **request: Any) -> tuple[list[httpx.Response], float]:
    """Requests from ``threads`` clients spread over both gateways for ``seconds``: (replies, the
    time from the first admission to the last). A request is admitted as soon as it is tokenized,
    before any generation: its sending time stands for it."""
    replies: list[httpx.Response] = []
    admitted_at: list[float] = []
    lock = threading.Lock()
    started = time.monotonic()

    def client(i: int) -> None:
        with httpx.Client(timeout=10) as http:
            n = i
            while time.monotonic() - started < seconds:
                gw = gateways[n % len(gateways)]
                n += 1
                sent = time.monotonic()
                reply = http.post(f"{gw.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}],
                                        **request})
                with lock:
                    replies.append(reply)
                    if reply.status_code == 200:
                        admitted_at.append(sent)

    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return replies, max(admitted_at) - min(admitted_at)


def test_rpm_holds_across_two_gateways(pair: list[Gateway]) -> None:
    rpm = 60  # per PERIOD_S: a bucket of 60, refilled at 30 per second
    key = new_key(pair[0], rpm=rpm)
    replies, span = hammer(pair, key["key"], seconds=3.0, max_tokens=1)
    admitted = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    assert len(admitted) + len(refused) == len(replies), {r.status_code for r in replies}
    expected = rpm + rpm / PERIOD_S * span  # the full bucket, then the refill rate
    assert abs(len(admitted) - expected) <= 0.05 * expected, (len(admitted), expected, len(replies))
    assert {r.request.url.port for r in admitted} == {gw.port for gw in pair}, "both gateways admitted some"
    for reply in admitted:
        assert_limit_headers(reply, "requests")
        assert reply.headers["x-ratelimit-limit-requests"] == str(rpm)
    for reply in refused:
        error = assert_refused(reply, "requests")
        assert f"key {key['id']}" in error["message"] and "requests per minute (RPM): Limit 60" in error["message"]
        assert reply.headers["x-ratelimit-remaining-requests"] == "0"
        assert_limit_headers(reply, "requests")
    assert len(refused) > len(admitted), "the clients asked for far more than the limit"


def test_tpm_holds_across_two_gateways(pair: list[Gateway]) -> None:
    probe = chat(pair[0], new_key(pair[0])["key"], max_tokens=2).json()["usage"]
    per_request = probe["prompt_tokens"] + 2  # reserved = charged: the reply is longer than max_tokens
    tpm = 30 * per_request
    key = new_key(pair[0], tpm=tpm)
    replies, span = hammer(pair, key["key"], seconds=3.0, max_tokens=2)
    admitted = [r for r in replies if r.status_code == 200]
    tokens = sum(r.json()["usage"]["total_tokens"] for r in admitted)
    expected = tpm + tpm / PERIOD_S * span
    assert abs(tokens - expected) <= 0.05 * expected, (tokens, expected)
    refused = [r for r in replies if r.status_code == 429]
    assert refused
    for reply in refused:
        error = assert_refused(reply, "tokens")
        assert f"key {key['id']}" in error["message"] and f"tokens per minute (TPM): Limit {tpm}" in error["message"]
    for reply in admitted:
        assert_limit_headers(reply, "tokens")
        assert "x-ratelimit-limit-requests" not in reply.headers, "no request limit: no request headers"


def test_tokens_reserved_for_max_tokens_are_given_back(pair: list[Gateway]) -> None:
    key = new_key(pair[0], tpm=100_000)
    reply = chat(pair[0], key["key"], max_tokens=200)
    assert reply.status_code == 200
    remaining_at_admission = int(reply.headers["x-ratelimit-remaining-tokens"])
    assert remaining_at_admission <= 100_000 - 200, "the prompt and max_tokens were reserved"
    used = reply.json()["usage"]["total_tokens"]
    models = httpx.get(f"{pair[1].url}/v1/models", headers={"Authorization": f"Bearer {key['key']}"}, timeout=10)
    assert models.status_code == 200
    assert 100_000 - used <= int(models.headers["x-ratelimit-remaining-tokens"]) <= 100_000, "settled to the usage"


def test_a_tenant_limit_covers_all_its_keys(pair: list[Gateway]) -> None:
    tenant = f"t{uuid.uuid4().hex[:8]}"
    keys = [new_key(pair[0], tenant) for _ in range(2)]
    reply = admin(pair[0], "PUT", f"/tenants/{tenant}/limits", {"rpm": 3})
    assert reply.status_code == 200 and reply.json()["limits"]["rpm"] == 3
    replies = [chat(pair[i % 2], keys[i % 2]["key"]) for i in range(4)]
    assert [r.status_code for r in replies] == [200, 200, 200, 429]
    error = assert_refused(replies[3], "requests")
    assert f"tenant {keys[0]['tenant_id']}" in error["message"]


def test_every_v1_answer_carries_the_headers(pair: list[Gateway]) -> None:
    key = new_key(pair[0], rpm=1000, tpm=1_000_000)
    auth = {"Authorization": f"Bearer {key['key']}"}
    models = httpx.get(f"{pair[0].url}/v1/models", headers=auth, timeout=10)
    invalid = httpx.post(f"{pair[0].url}/v1/chat/completions", headers=auth, json={"model": "fake-model"}, timeout=10)
    with httpx.stream("POST", f"{pair[1].url}/v1/chat/completions", headers=auth, timeout=10, json={
            "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}) as stream:
        assert stream.status_code == 200
        assert_limit_headers(stream, "requests", "tokens")
        stream.read()
    completion = httpx.post(f"{pair[1].url}/v1/completions", headers=auth, timeout=10,
                            json={"model": "fake-model", "prompt": "hello", "max_tokens": 2})
    response = httpx.post(f"{pair[0].url}/v1/responses", headers=auth, timeout=10,
                          json={"model": "fake-model", "input": "hello", "max_output_tokens": 2})
    for reply, status in ((models, 200), (invalid, 400), (completion, 200), (response, 200)):
        assert reply.status_code == status, reply.text
        assert_limit_headers(reply, "requests", "tokens")
    assert int(completion.headers["x-ratelimit-remaining-requests"]) < 1000


def test_the_scheduler_429_stays_its_own(pair: list[Gateway], backend: FakeBackend) -> None:
    key = new_key(pair[0], rpm=1000)
    backend.post("/reject", {"reason": "ttft_slo", "message": "predicted TTFT 40 s > 30 s", "retry_after_s": 3})
    reply = chat(pair[0], key["key"])
    error = assert_refused(reply, "rate_limit_error")
    assert "ttft_slo" in error["message"]
    assert_limit_headers(reply, "requests")


def test_concurrent_requests_across_gateways(pair: list[Gateway]) -> None:
    key = new_key(pair[0], max_concurrent=2)
    auth = {"Authorization": f"Bearer {key['key']}"}
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "#loop #delay=0.05 slow"}],
            "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=10) as http:
        streams = [http.stream("POST", f"{gw.url}/v1/chat/completions", headers=auth, json=body) for gw in pair]
        opened = [s.__enter__() for s in streams]
        try:
            assert [r.status_code for r in opened] == [200, 200]
            third = chat(pair[1], key["key"])
            error = assert_refused(third, "concurrent_requests")
            assert f"key {key['id']}" in error["message"] and "Limit 2 requests in flight" in error["message"]
        finally:
            streams[0].__exit__(None, None, None)  # the client goes away: its slot is freed
        deadline = time.monotonic() + 3
        while (reply := chat(pair[1], key["key"])).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reply.status_code == 200
        streams[1].__exit__(None, None, None)
    sequential = [chat(pair[i % 2], key["key"]) for i in range(6)]
    assert [r.status_code for r in sequential] == [200] * 6, "a finished request's slot is free at once"


def test_a_killed_gateway_gives_its_slots_back(pair: list[Gateway], backend: FakeBackend, redis: RedisServer,
                                               tmp_path: Path) -> None:
    database = yaml.safe_load(Path(pair[0].argv[-1]).read_text())["auth"]["database_url"]
    doomed = limited_gateway(tmp_path, backend, database, redis.url)
    doomed.start_gateway()
    key = new_key(pair[0], max_concurrent=1)
    auth = {"Authorization": f"Bearer {key['key']}"}
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "#loop #delay=0.05 slow"}],
            "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{doomed.url}/v1/chat/completions", headers=auth, json=body, timeout=10) as stream:
        assert stream.status_code == 200
        assert_refused(chat(pair[0], key["key"]), "concurrent_requests")
        doomed.proc.kill()  # kill -9: nothing is released
        doomed.proc.wait()
        killed = time.monotonic()
    assert_refused(chat(pair[0], key["key"]), "concurrent_requests")
    while (reply := chat(pair[0], key["key"])).status_code == 429 and time.monotonic() - killed < 5:
        time.sleep(0.1)
    assert reply.status_code == 200
    assert time.monotonic() - killed <= LEASE_S + 1.0, "back within the lease time"


def test_a_spent_budget_is_insufficient_quota(pair: list[Gateway]) -> None:
    key = new_key(pair[0], budget_usd="0.00001")  # less than one request costs at the default prices
    assert chat(pair[0], key["key"]).status_code == 200, "refused once spent, not before: this one overspends"
    reply = chat(pair[1], key["key"])
    error = assert_refused(reply, "insufficient_quota", code="insufficient_quota")
    assert f"key {key['id']}" in error["message"] and "monthly budget" in error["message"]
    assert int(reply.headers["retry-after"]) > 60, "until the month ends"
    raised = admin(pair[0], "PUT", f"/keys/{key['id']}/limits", {"budget_usd": "1"})
    assert raised.json()["limits"]["budget_usd"] == "1"
    assert chat(pair[0], key["key"]).status_code == 200, "a raised budget applies at once on this gateway"


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_when_redis_is_down(backend: FakeBackend, tmp_path: Path, mode: str) -> None:
    later = RedisServer(tmp_path)  # its port is known; it starts during the test
    gw = limited_gateway(tmp_path, backend, f"sqlite:///{tmp_path}/tenancy.sqlite3", later.url,
                         on_store_error=mode, tenant={"rpm": 1})
    gw.start_gateway(healthy=mode == "open")  # closed: the store is required, so the gateway is not ready
    try:
        key = new_key(gw)
        first = chat(gw, key["key"])
        health = httpx.get(f"{gw.url}/health", timeout=10)
        if mode == "open":
            assert [first.status_code, chat(gw, key["key"]).status_code] == [200, 200], "served without limits"
            assert "x-ratelimit-limit-requests" not in first.headers
            assert health.status_code == 200, health.text
        else:
            assert first.status_code == 503
            assert first.json()["error"]["code"] == "rate_limit_store_unavailable"
            assert int(first.headers["retry-after"]) >= 1
            assert health.status_code == 503 and "rate-limit store unreachable" in health.json()["reason"], health.text
        later.start()
        gw.wait_gateway(timeout_s=10)  # ready again once the store answers
        assert chat(gw, key["key"]).status_code == 200, "the store is back"
        assert_refused(chat(gw, key["key"]), "requests")
    finally:
        assert gw.stop() == 0
        later.stop()


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_spent_budget_stays_spent_after_the_counters_are_lost(backend: FakeBackend, redis: RedisServer,
                                                                tmp_path: Path, store: str) -> None:
    """The ledger is the truth of spend: a gateway restarted with in-process counters, or a Redis
    that lost its keys, still refuses a tenant whose month's spend in the ledger is over budget."""
    gw = limited_gateway(tmp_path, backend, f"sqlite:///{tmp_path}/tenancy.sqlite3",
                         "memory" if store == "memory" else redis.url)
    gw.start_gateway()
    try:
        tenant = f"t{uuid.uuid4().hex[:8]}"
        key = new_key(gw, tenant=tenant)
        assert admin(gw, "PUT", f"/tenants/{tenant}/limits", {"budget_usd": "0.00001"}).status_code == 200
        assert chat(gw, key["key"]).status_code == 200, "this one overspends"
        assert_refused(chat(gw, key["key"]), "insufficient_quota", code="insufficient_quota")
        assert gw.stop() == 0
        if store == "redis":
            asyncio.run(_forget_spend(redis.url))
        gw.start_gateway()
        error = assert_refused(chat(gw, key["key"]), "insufficient_quota", code="insufficient_quota")
        assert "monthly budget" in error["message"]
    finally:
        gw.stop()


async def _forget_spend(url: str) -> None:
    """What a Redis restarted without persistence would have lost: the spend counters."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    keys = [k async for k in client.scan_iter(match="*spend*")]
    assert keys, "the spend was counted in Redis"
    await client.delete(*keys)
    await client.aclose()
