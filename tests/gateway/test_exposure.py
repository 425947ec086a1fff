"""Safe by default on a network: a keyless gateway bound where other hosts reach it refuses to
start unless told so in so many words, and a gateway on loopback answers only loopback Host
names, so a web page cannot drive it through DNS rebinding. The refusal is a real process's exit
(what an operator sees); the serving gateways are in-process (``in_process.py``)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from .in_process import InProcessGateway
from .support import REPO_ROOT, FakeBackend, Gateway


def configured(gw: Gateway, **changes: Any) -> Gateway:
    """``gw`` with its YAML config changed (nested dicts merged one level)."""
    path = Path(gw.argv[-1])
    config = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(config))
    return gw


def chat_status(gw: Gateway, host: str | None = None) -> int:
    headers = {"Host": host} if host is not None else {}
    return httpx.post(f"{gw.url}/v1/chat/completions", headers=headers, timeout=10, json={
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code


@pytest.mark.slow  # the exit code and message of the process that refuses
def test_a_keyless_gateway_on_a_network_address_refuses_to_start(backend: FakeBackend, tmp_path: Path) -> None:
    gw = configured(Gateway(tmp_path, backend.address), listen={"host": "0.0.0.0"})
    result = subprocess.run(gw.argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "refusing to serve without API keys on '0.0.0.0'" in result.stderr
    assert "auth.allow_unauthenticated_network" in result.stderr


def test_said_in_so_many_words_it_serves_keyless_on_the_network(backend: FakeBackend, tmp_path: Path) -> None:
    gw = configured(InProcessGateway(tmp_path, backend.address), listen={"host": "0.0.0.0"},
                    auth={"allow_unauthenticated_network": True})
    gw.start_gateway()
    try:
        assert chat_status(gw) == 200
        assert chat_status(gw, "gateway.internal.example:8000") == 200, "off loopback, any Host unless listed"
    finally:
        assert gw.stop() == 0


def test_a_loopback_gateway_answers_only_loopback_host_names(backend: FakeBackend, tmp_path: Path) -> None:
    gw = InProcessGateway(tmp_path, backend.address)
    gw.start_gateway()
    try:
        assert chat_status(gw) == 200
        assert chat_status(gw, f"localhost:{gw.port}") == 200
        assert chat_status(gw, f"[::1]:{gw.port}") == 200
        assert chat_status(gw, f"attacker.example:{gw.port}") == 400, "a rebound DNS name is refused"
        assert httpx.get(f"{gw.url}/metrics", headers={"Host": "attacker.example"}, timeout=10).status_code == 400
    finally:
        assert gw.stop() == 0


def test_an_allow_list_is_the_hosts_answered(backend: FakeBackend, tmp_path: Path) -> None:
    gw = configured(InProcessGateway(tmp_path, backend.address),
                    listen={"allowed_hosts": ["api.example.com", "*.corp.example"]})
    gw.start_gateway(healthy=False)
    try:
        assert chat_status(gw, "api.example.com") == 200
        assert chat_status(gw, "llm.corp.example:443") == 200
        assert chat_status(gw) == 400, "not listed, even on loopback"
    finally:
        assert gw.stop() == 0
