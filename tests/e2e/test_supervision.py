"""`crescent up` keeps the platform running: a crashed service comes back on its ports, the
launcher survives whatever it prints, and requests succeed again."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from crescent.services import cli
from crescent.services.launcher import Backoff, Platform, PlatformPlan, ServiceSpec, SupervisionEvent, describe_exit
from tests.e2e.stack import Stack, free_port, process_alive, start_stack, stop_stack

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


class CrashLoop(Platform):
    """decode-0 exits with code 3 at once, its log line full of brackets; the others idle."""

    def command(self, spec: ServiceSpec, config_path: Path) -> list[str]:
        if spec.name == "decode-0":
            return [sys.executable, "-c", "print('cannot bind [::]:1 [/red]'); raise SystemExit(3)"]
        return [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.mark.slow
def test_a_service_that_keeps_crashing_is_restarted_with_backoff_and_reported(tmp_path: Path) -> None:
    now = [0.0]
    plan = PlatformPlan("m", "127.0.0.1", free_port(), 1, 1, 256, 1 << 20, 16)
    platform = CrashLoop(plan, tmp_path, clock=lambda: now[0])
    platform.start()
    decode = platform.children["decode-0"]
    try:
        delays = []
        for _ in range(5):
            decode.proc.wait(30)
            (crash,) = platform.supervise()
            assert (crash.kind, crash.name) == ("crashed", "decode-0") and "exit code 3" in crash.detail
            assert "cannot bind [::]:1 [/red]" in crash.log_tail
            delays.append(decode.restart_at - now[0])
            now[0] += delays[-1] / 2
            assert platform.supervise() == []  # not yet
            now[0] += delays[-1] / 2
            (restart,) = platform.supervise()
            assert restart.kind == "restarted"
            manifest = {s["name"]: s for s in json.loads((tmp_path / "services.json").read_text())}
            assert manifest["decode-0"]["pid"] == decode.proc.pid
        assert delays == [0.5, 1, 2, 4, 8]
        assert manifest["decode-0"]["restarts"] == 5
        assert all(manifest[n]["restarts"] == 0 and process_alive(manifest[n]["pid"]) for n in manifest if n != "decode-0")
        # Up for longer than reset_after_s before this crash: the backoff starts over.
        decode.proc.wait(30)
        now[0] += platform.backoff.reset_after_s
        (crash,) = platform.supervise()
        assert decode.restart_at - now[0] == 0.5
    finally:
        platform.stop(grace_s=5)
    assert not any(process_alive(p.pid) for p in platform.procs.values())


class ExitsCleanly(Platform):
    """The scheduler exits with code 0 at once (someone sent it SIGTERM); the others idle."""

    def command(self, spec: ServiceSpec, config_path: Path) -> list[str]:
        code = "raise SystemExit(0)" if spec.name == "scheduler" else "import time; time.sleep(120)"
        return [sys.executable, "-c", code]


@pytest.mark.slow
def test_a_service_that_exits_unasked_with_code_0_is_restarted_too(tmp_path: Path) -> None:
    now = [0.0]
    platform = ExitsCleanly(PlatformPlan("m", "127.0.0.1", free_port(), 1, 1, 256, 1 << 20, 16), tmp_path,
                            clock=lambda: now[0])
    platform.start()
    try:
        platform.children["scheduler"].proc.wait(30)
        (exited,) = platform.supervise()
        assert (exited.kind, exited.name) == ("exited", "scheduler") and "exit code 0" in exited.detail
        now[0] += 0.5
        assert [e.kind for e in platform.supervise()] == ["restarted"]
    finally:
        platform.stop(grace_s=5)


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


@pytest.mark.slow
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


# A ~1,000-token prompt: its KV (~45 MB) is still crossing to decode, or being taken over by the
# aggregated engine's decode side, when the first chunk reaches the client.
LONG_PROMPT = "Here is a list of words to remember: " + " ".join(f"word{i}" for i in range(330)) + ". Count to twenty."


@pytest.mark.parametrize("mode, prompt, press_at_line", [
    ("pools", "Count from one to twenty in words.", 3),  # mid-stream
    ("pools", LONG_PROMPT, 1),  # the prompt's KV still on its way to decode
    ("aggregated", LONG_PROMPT, 1),
], ids=["pools-mid-stream", "pools-during-handoff", "aggregated-during-handoff"])
@pytest.mark.slow
def test_ctrl_c_lets_an_open_stream_finish_then_stops_everything(tmp_path: Path, mode: str, prompt: str,
                                                                 press_at_line: int) -> None:
    port = free_port()
    log = open(tmp_path / "up.log", "wb")
    # Its own session, like a shell's foreground job: Ctrl-C goes to the whole group.
    proc = subprocess.Popen(
        [sys.executable, "-m", "crescent.services.cli", "up", "--port", str(port), "--run-dir", str(tmp_path),
         *SMALL, "--drain-grace", "60", "--aggregated", "1" if mode == "aggregated" else "0"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        wait_until(lambda: (tmp_path / "services.json").exists() or proc.poll() is not None, 300, "crescent up")
        assert proc.poll() is None, (tmp_path / "up.log").read_text()
        pids = [s["pid"] for s in json.loads((tmp_path / "services.json").read_text())]
        body = {"model": "smollm2-135m-instruct", "max_tokens": 24, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": prompt}]}
        lines: list[str] = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == press_at_line:  # now the operator presses Ctrl-C
                    os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    chunks = [json.loads(line[5:]) for line in lines if line.startswith("data:") and line != "data: [DONE]"]
    assert lines[-1] == "data: [DONE]" or lines[-2:] == ["data: [DONE]", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert not [p for p in pids if process_alive(p)], "services outlived crescent up"
