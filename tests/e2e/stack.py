"""Start and stop a real ``crescent up`` platform for tests: separate processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.ports import free_port  # noqa: F401  (re-exported for the tests here)


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@dataclass
class Stack:
    url: str
    run_dir: Path
    proc: subprocess.Popen[bytes]

    @property
    def services(self) -> list[dict]:
        return json.loads((self.run_dir / "services.json").read_text())

    def service(self, name: str) -> dict:
        return next(s for s in self.services if s["name"] == name)

    def metric(self, name: str, metric: str, labels: dict[str, str] | None = None) -> float:
        """Current value of one sample on a service's /metrics (0 when absent)."""
        text = httpx.get(self.service(name)["metrics_url"], timeout=5).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted((labels or {}).items()))
        total = 0.0
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith(metric):
                continue
            head, value = line.rsplit(" ", 1)
            sample, _, label_text = head.partition("{")
            if sample != metric:
                continue
            have = ",".join(sorted(label_text.rstrip("}").split(","))) if label_text else ""
            if all(part in have.split(",") for part in want.split(",") if part):
                total += float(value)
        return total


    def wait_metric(self, name: str, metric: str, labels: dict[str, str] | None = None, *,
                    above: float = 0.0, timeout_s: float = 60) -> float:
        """Poll until the sample is above ``above`` (what a background step, such as the kvstore's
        demotion to a lower tier, shows when it is done); its value, or AssertionError."""
        deadline = time.monotonic() + timeout_s
        while (value := self.metric(name, metric, labels)) <= above:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}'s {metric}{labels or ''} still {value} after {timeout_s:.0f} s")
            time.sleep(0.1)
        return value

    def wait_heartbeats(self, instances: tuple[str, ...], timeout_s: float = 60) -> None:
        """Until each of ``instances`` has sent the scheduler a heartbeat (its load report) since
        this call: what the scheduler knows of them then includes everything done before it."""
        from crescent.protos import scheduler_pb2, scheduler_pb2_grpc
        from tests.admin_channel import admin_channel

        since = time.monotonic()
        deadline = since + timeout_s
        with admin_channel(self.run_dir, self.service("scheduler")["grpc"]) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while True:
                asked = time.monotonic()
                ages = {s.info.instance_id: s.last_heartbeat_age_s
                        for s in stub.ListInstances(scheduler_pb2.ListInstancesRequest(), timeout=5).instances}
                if all(name in ages and ages[name] < asked - since for name in instances):
                    return
                if asked > deadline:
                    raise AssertionError(f"no heartbeat from all of {instances} in {timeout_s:.0f} s: ages {ages}")
                time.sleep(0.1)


# These tests check the cache's mechanics with short prompts, so they keep every prompt's blocks;
# test_tenant_isolation runs with the served default (Kimi's rule: only prompts over 256 tokens).
CACHE_SHORT_PROMPTS = {"CRESCENT_PREFILL__ENGINE__MIN_CACHED_PROMPT_TOKENS": "0",
                       "CRESCENT_AGGREGATED__ENGINE__MIN_CACHED_PROMPT_TOKENS": "0"}


def start_stack(run_dir: Path, *extra_args: str, timeout_s: float = 300, env: dict[str, str] | None = None) -> Stack:
    """``crescent up`` on a free port; ``env`` adds settings overrides (CRESCENT_<SERVICE>__...)."""
    port = free_port()
    log = open(run_dir / "up.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "crescent.services.cli", "up", "--port", str(port), "--run-dir", str(run_dir), *extra_args],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "CRESCENT_LOG_LEVEL": "INFO", **CACHE_SHORT_PROMPTS, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "services.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("crescent up failed:\n" + (run_dir / "up.log").read_text(errors="replace")[-4000:])
        time.sleep(0.3)
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    return Stack(url, run_dir, proc)


def stop_stack(stack: Stack) -> None:
    """SIGTERM, as Ctrl-C or a container runtime would; every service must be gone afterwards."""
    pids = [s["pid"] for s in stack.services]
    stack.proc.send_signal(signal.SIGTERM)
    try:
        assert stack.proc.wait(timeout=30) == 0, "crescent up should exit 0 on SIGTERM"
    except subprocess.TimeoutExpired:
        stack.proc.kill()
        raise
    left = [pid for pid in pids if process_alive(pid)]
    assert not left, f"services still running after crescent up stopped: {left}"
