"""The gateway's database (keys, tenants, the ledger: PostgreSQL here, a real server) goes away
and comes back: /health says unready while it is away, so the pod leaves the Service; a request
whose key needs the database gets a 503 with Retry-After, not a 500 and a traceback; all of it
heals when the database is back."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.tenancy.postgres import postgres_instance

from .support import FakeBackend, Gateway

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)

ADMIN_KEY = "admin-" + uuid.uuid4().hex


def health(gw: Gateway) -> httpx.Response:
    return httpx.get(f"{gw.url}/health", timeout=10)


def chat(gw: Gateway, key: str) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=20, json={
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def wait_for(check, timeout_s: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.25)


def test_a_database_outage_is_unready_and_503_then_heals(backend: FakeBackend, tmp_path: Path) -> None:
    with postgres_instance() as database:
        gw = Gateway(tmp_path, backend.address, auth={"enabled": True, "admin_key": ADMIN_KEY,
                                                      "database_url": database.url, "key_cache_s": 0})
        gw.start_gateway()
        try:
            made = httpx.post(f"{gw.url}/admin/keys", json={"tenant": "acme", "create_tenant": True},
                              headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
            assert made.status_code == 201, made.text
            key = made.json()["key"]
            assert chat(gw, key).status_code == 200 and health(gw).status_code == 200

            database.stop()
            wait_for(lambda: health(gw).status_code == 503)
            assert "database unreachable" in health(gw).json()["reason"]
            refused = chat(gw, key)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "database_unavailable" and refused.headers["retry-after"]

            database.start()
            wait_for(lambda: health(gw).status_code == 200)
            wait_for(lambda: chat(gw, key).status_code == 200)
        finally:
            gw.stop()
