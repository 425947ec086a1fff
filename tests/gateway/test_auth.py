"""API keys on the gateway (served in-process, ``in_process.py``): refusals with OpenAI's error shape,
the admin API, revocation and expiry, per-tenant cache salts (against the fake engines, which
report cached tokens from salted block keys as a real prefix cache does)."""

from __future__ import annotations

import re
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .in_process import InProcessGateway
from .support import FakeBackend, Gateway, served_salt

ADMIN_KEY = "admin-" + uuid.uuid4().hex
KEY_CACHE_S = 1.0


@pytest.fixture(scope="module")
def secured(backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = InProcessGateway(tmp_path_factory.mktemp("auth"), backend.address,
                          # Its tests refuse dozens of keys from one address on purpose; the throttle has its own
                          # (tests/security/test_gateway_hardening.py).
                          auth={"enabled": True, "admin_key": ADMIN_KEY, "key_cache_s": KEY_CACHE_S,
                                "failed_auth_burst": 0})
    gw.start_gateway()
    yield gw
    assert gw.stop() == 0


def database_of(gw: Gateway) -> str:
    config = next(Path(p) for p in gw.argv if p.endswith(".yaml"))
    return f"sqlite:///{config.parent}/tenancy-{gw.port}.sqlite3"


def admin(gw: Gateway, method: str, path: str, body: dict[str, Any] | None = None, key: str = ADMIN_KEY) -> httpx.Response:
    return httpx.request(method, f"{gw.url}/admin{path}", json=body, headers={"Authorization": f"Bearer {key}"},
                         timeout=10)


def new_key(gw: Gateway, tenant: str, **extra: Any) -> dict[str, Any]:
    reply = admin(gw, "POST", "/keys", {"tenant": tenant, "create_tenant": True, **extra})
    assert reply.status_code == 201, reply.text
    return reply.json()


def chat(gw: Gateway, key: str | None, content: str = "hello", **extra: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{gw.url}/v1/chat/completions", headers=headers, timeout=10, json={
        "model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra})


def assert_refused(reply: httpx.Response, code: str) -> None:
    assert reply.status_code == 401, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, None)
    assert reply.headers["www-authenticate"] == "Bearer"


V1 = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
      ("GET", "/v1/models"), ("GET", "/v1/models/fake-model"), ("GET", "/v1/responses/resp_x"),
      ("DELETE", "/v1/responses/resp_x")]


@pytest.mark.parametrize(("method", "path"), V1)
def test_every_v1_endpoint_needs_a_key(secured: Gateway, method: str, path: str) -> None:
    missing = httpx.request(method, f"{secured.url}{path}", json={}, timeout=10)
    assert_refused(missing, "missing_api_key")
    assert "Authorization: Bearer" in missing.json()["error"]["message"]
    wrong = httpx.request(method, f"{secured.url}{path}", json={}, timeout=10,
                          headers={"Authorization": "Bearer crs-" + "x" * 43})
    assert_refused(wrong, "invalid_api_key")
    assert wrong.json()["error"]["message"] == "Incorrect API key provided: crs-xxxx…xxxx."


def test_health_and_metrics_stay_open(secured: Gateway) -> None:
    assert httpx.get(f"{secured.url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{secured.url}/metrics", timeout=5).status_code == 200


def test_the_key_is_checked_before_the_body_is_read_or_parsed(secured: Gateway) -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    started = time.monotonic()
    keyless = httpx.post(f"{secured.url}/v1/chat/completions", content=deep, timeout=10,
                         headers={"Content-Type": "application/json"})
    assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "missing_api_key"
    # A keyless request that announces a body and never sends it is answered at once, not at the body timeout.
    with socket.create_connection(("127.0.0.1", secured.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 401")
    assert time.monotonic() - started < 5
    key = new_key(secured, "deep")["key"]
    too_deep = httpx.post(f"{secured.url}/v1/chat/completions", content=deep, timeout=10,
                          headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    assert too_deep.status_code == 400, too_deep.text  # the parser's depth limit: the body's fault, not a 500
    assert chat(secured, key).status_code == 200, "and the gateway keeps serving"


def test_tenant_spend_in_the_metrics_is_for_the_admin_key_only(secured: Gateway) -> None:
    """Per-tenant spend and cache savings are tenant data: the open /metrics leaves them out."""
    made = new_key(secured, "metered")
    assert chat(secured, made["key"]).status_code == 200

    def scrape(key: str | None) -> tuple[str, set[str]]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        reply = httpx.get(f"{secured.url}/metrics", headers=headers, timeout=5)
        assert reply.status_code == 200
        return reply.text, set(re.findall(r'tenant="([^"]+)"', reply.text))

    public, tenants = scrape(None)
    assert "crescent_gateway_requests_total" in public and not tenants, "no tenant id nor spend without the admin key"
    assert not scrape(made["key"])[1], "nor with a tenant's key"
    admin_view, tenants = scrape(ADMIN_KEY)
    assert made["tenant_id"] in tenants and "crescent_gateway_spend_usd_total" in admin_view


def test_a_created_key_works_through_the_openai_client(secured: Gateway, model: str, backend: FakeBackend) -> None:
    created = new_key(secured, "acme", name="sdk")
    assert created["key"].startswith("crs-") and created["status"] == "active"
    with openai.OpenAI(base_url=f"{secured.url}/v1", api_key=created["key"], max_retries=0, timeout=10) as client:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert [m.id for m in client.models.list().data] == [model]
    prefill = next(p for p in backend.get("/prefills") if p["request_id"] == reply.id)
    assert prefill["cache_salt"] == served_salt(tenant_id=created["tenant_id"]).hex()
    with openai.OpenAI(base_url=f"{secured.url}/v1", api_key="crs-wrong", max_retries=0, timeout=10) as client:
        with pytest.raises(openai.AuthenticationError) as refused:
            client.models.list()
    assert refused.value.code == "invalid_api_key"


def test_the_admin_api_needs_the_admin_key(secured: Gateway, gateway: Gateway) -> None:
    assert_refused(httpx.get(f"{secured.url}/admin/keys", timeout=5), "missing_api_key")
    assert_refused(admin(secured, "GET", "/keys", key="not-the-admin-key"), "invalid_api_key")
    tenant_key = new_key(secured, "acme")["key"]
    assert_refused(admin(secured, "POST", "/tenants", {"name": "sneaky"}, key=tenant_key), "invalid_api_key")
    off = admin(gateway, "GET", "/keys")  # the session gateway has no admin key: the admin API is off
    assert off.status_code == 403 and off.json()["error"]["code"] == "permission_denied"


def test_admin_tenants_and_keys(secured: Gateway) -> None:
    made = admin(secured, "POST", "/tenants", {"name": "globex"})
    assert made.status_code == 201 and made.json()["id"].startswith("ten_")
    assert admin(secured, "POST", "/tenants", {"name": "globex"}).status_code == 409
    names = [t["name"] for t in admin(secured, "GET", "/tenants").json()["data"]]
    assert {"default", "globex"} <= set(names)
    assert admin(secured, "POST", "/keys", {"tenant": "nobody"}).json()["error"]["code"] == "tenant_not_found"
    key = new_key(secured, "globex", name="ops")
    listed = admin(secured, "GET", "/keys?tenant=globex").json()["data"]
    assert [k["id"] for k in listed] == [key["id"]] and "key" not in listed[0]
    assert listed[0]["key_prefix"] == key["key"][:12]


def test_revoked_key_is_refused_at_once_here(secured: Gateway) -> None:
    key = new_key(secured, "acme")
    assert chat(secured, key["key"]).status_code == 200
    revoked = admin(secured, "POST", f"/keys/{key['id']}/revoke")
    assert revoked.status_code == 200 and revoked.json()["status"] == "revoked"
    assert_refused(chat(secured, key["key"]), "invalid_api_key")
    assert admin(secured, "POST", "/keys/key_nope/revoke").status_code == 404


@pytest.mark.slow  # runs `crescent keys revoke`, a process
def test_revoked_in_the_database_is_refused_within_the_key_cache_time(secured: Gateway) -> None:
    """Revoked by `crescent keys revoke` (another gateway, an operator): refused within key_cache_s."""
    key = new_key(secured, "acme")
    assert chat(secured, key["key"]).status_code == 200  # now cached as valid
    done = subprocess.run([sys.executable, "-m", "crescent.services.cli", "keys", "revoke", key["id"],
                           "--database-url", database_of(secured)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    revoked_at = time.monotonic()
    while chat(secured, key["key"]).status_code == 200:
        assert time.monotonic() - revoked_at < KEY_CACHE_S + 1.0, "still accepted after the key cache time"
        time.sleep(0.1)


def test_expired_key_is_refused(secured: Gateway) -> None:
    key = new_key(secured, "acme", expires_in_s=1.5)
    assert chat(secured, key["key"]).status_code == 200
    time.sleep(1.6)
    assert_refused(chat(secured, key["key"]), "invalid_api_key")


def test_unknown_and_revoked_keys_take_the_same_time(secured: Gateway) -> None:
    """Both are looked up in the database the first time (then cached alike): the medians of first
    lookups differ by well under a millisecond next to the request's own time."""
    revoked = []
    for _ in range(15):
        key = new_key(secured, "timing")
        admin(secured, "POST", f"/keys/{key['id']}/revoke")
        revoked.append(key["key"])
    unknown = ["crs-" + uuid.uuid4().hex + uuid.uuid4().hex[:11] for _ in revoked]
    times: dict[str, list[float]] = {"unknown": [], "revoked": []}
    with httpx.Client(timeout=10) as client:
        client.get(f"{secured.url}/health")
        for u, r in zip(unknown, revoked):
            for kind, key in (("unknown", u), ("revoked", r)):
                start = time.perf_counter()
                reply = client.get(f"{secured.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
                times[kind].append(time.perf_counter() - start)
                assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    medians = {kind: statistics.median(t) * 1000 for kind, t in times.items()}
    print(f"first-lookup refusal medians (ms): {medians}")
    assert abs(medians["unknown"] - medians["revoked"]) < 3.0, medians


def test_tenants_never_share_cached_blocks(secured: Gateway) -> None:
    a, b = new_key(secured, "tenant-a")["key"], new_key(secured, "tenant-b")["key"]
    prompt = "a long prompt that two tenants both send " * 4 + uuid.uuid4().hex

    def cached(key: str, **extra: Any) -> int:
        reply = chat(secured, key, prompt, **extra)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(a) == 0
    assert cached(a) > 0, "within a tenant the cache hits"
    assert cached(b) == 0, "another tenant's identical prompt is not a hit"
    assert cached(b, cache_salt="") == 0, "an empty client salt is not 'no salt'"
    assert cached(b, cache_salt="x") == 0 and cached(b, cache_salt="x") > 0, "a client salt narrows within a tenant"
    assert cached(a, cache_salt="x") == 0, "the same client salt in another tenant shares nothing"


def test_open_mode_serves_everyone_as_the_default_tenant(gateway: Gateway, backend: FakeBackend) -> None:
    """The session gateway runs with auth off: any or no key, one tenant, one salt."""
    anyone = chat(gateway, "whatever")
    nobody = chat(gateway, None)
    assert anyone.status_code == nobody.status_code == 200
    salts = {p["cache_salt"] for p in backend.get("/prefills") if p["request_id"] in (anyone.json()["id"],
                                                                                       nobody.json()["id"])}
    assert salts == {served_salt().hex()}


def test_stored_responses_belong_to_their_tenant(secured: Gateway, model: str) -> None:
    """Another tenant can neither read, continue nor delete a stored response, even knowing its id."""
    made = new_key(secured, "tenant-a")
    owner, owner_tenant, other = made["key"], made["tenant_id"], new_key(secured, "tenant-b")["key"]
    with (openai.OpenAI(base_url=f"{secured.url}/v1", api_key=owner, max_retries=0, timeout=10) as mine,
          openai.OpenAI(base_url=f"{secured.url}/v1", api_key=other, max_retries=0, timeout=10) as theirs):
        first = mine.responses.create(model=model, input="my name is Ada", max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            theirs.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            theirs.responses.create(model=model, previous_response_id=first.id, input="what is my name")
        with pytest.raises(openai.NotFoundError):
            theirs.responses.delete(first.id)
        # A key of the tenant named "default" (whose rows once had bare ids) naming the row as
        # "<tenant id>/<response id>": still someone else's response.
        default_key = new_key(secured, "default")["key"]
        with openai.OpenAI(base_url=f"{secured.url}/v1", api_key=default_key, max_retries=0, timeout=10) as plain:
            for spelled in (f"{owner_tenant}/{first.id}", f"tenant-a/{first.id}"):
                with pytest.raises(openai.NotFoundError):
                    plain.responses.create(model=model, previous_response_id=spelled, input="what is my name")
                with pytest.raises(openai.NotFoundError):
                    plain.responses.retrieve(spelled)
        assert mine.responses.retrieve(first.id).id == first.id
        assert mine.responses.create(model=model, previous_response_id=first.id, input="and?").previous_response_id \
            == first.id
        mine.responses.delete(first.id)
