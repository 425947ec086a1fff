"""`crescent up` keeps the platform running: a crashed service comes back on its ports, the
launcher survives whatever it prints, and requests succeed again."""

from __future__ import annotations

import io
import os
import signal
import time

import httpx
import pytest
from rich.console import Console

from crescent.services import cli
from crescent.services.launcher import Backoff, SupervisionEvent, describe_exit
from tests.e2e.stack import Stack, process_alive, start_stack, stop_stack

SMALL = ("--kv-capacity-tokens", "2048", "--kvstore-gb", "0.2", "--drain-grace", "5")


def test_backoff_doubles_to_its_cap() -> None:
    backoff = Backoff(initial_s=0.5, max_s=30.0)
    assert [backoff.delay(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]


def test_exits_are_described_by_code_or_signal() -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"


def test_log_lines_that_look_like_markup_print_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=200))
    tail = ("ERROR [/red] closing tag with nothing open", "[bold unclosed", "shape [1, 64]")
    cli.report(SupervisionEvent("crashed", "kvstore", "killed by SIGKILL after 3.0 s up", tail))
    printed = out.getvalue()
    assert "kvstore crashed: killed by SIGKILL" in printed
    assert all(line in printed for line in tail)


def chat(stack: Stack) -> httpx.Response:
    body = {"model": "smollm2-135m-instruct", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello"}]}
    return httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60)


def wait_until(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_killed_services_come_back_and_requests_succeed(tmp_path) -> None:
    stack = start_stack(tmp_path, *SMALL)
    try:
        assert chat(stack).status_code == 200
        for name in ("kvstore", "decode-0"):
            before = stack.service(name)
            os.kill(before["pid"], signal.SIGKILL)
            wait_until(lambda: stack.service(name)["pid"] != before["pid"], 30, f"{name} to be restarted")
            after = stack.service(name)
            assert after["health_url"] == before["health_url"] and after["restarts"] == 1  # same ports
            wait_until(lambda: healthy(after["health_url"]), 120, f"{name} to answer /health")
            assert stack.proc.poll() is None, "the launcher died"
        others = [s for s in stack.services if s["name"] not in ("kvstore", "decode-0")]
        assert all(s["restarts"] == 0 and process_alive(s["pid"]) for s in others)
        # The restarted decode re-registers: a request is served again soon.
        deadline = time.monotonic() + 60
        while (response := chat(stack)).status_code != 200 and time.monotonic() < deadline:
            time.sleep(1)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]
        up_log = (tmp_path / "up.log").read_text()
        assert "kvstore crashed: killed by SIGKILL" in up_log and "decode-0 restarted" in up_log
    finally:
        stop_stack(stack)
