"""The `crescent` command as an operator uses it: bad settings, start-up, and stopping cleanly."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.stack import free_port, process_alive

pytestmark = pytest.mark.slow  # its tests start processes: `make test-fast` leaves them out (tests/process_guard.py)

CLI = [sys.executable, "-m", "crescent.services.cli"]


@pytest.mark.parametrize(
    ("service", "config", "named"),
    [
        ("decode", "scheduler_address: 127.0.0.1:1\nengine:\n  max_batch_sise: 4\n", "engine.max_batch_sise"),
        ("prefill", "listen:\n  port: 99999\nscheduler_address: 127.0.0.1:1\n", "listen.port"),
        ("scheduler", "policy:\n  name: fastest\n", "policy.name"),
    ],
)
def test_serve_rejects_bad_settings_naming_the_key(tmp_path: Path, service: str, config: str, named: str):
    path = tmp_path / "bad.yaml"
    path.write_text(config)
    result = subprocess.run([*CLI, "serve", service, "--config", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert named in result.stderr.replace("\n", " ")


def test_up_leaves_no_orphans_when_the_launcher_is_killed(tmp_path: Path):
    proc = subprocess.Popen(
        [*CLI, "up", "--port", str(free_port()), "--run-dir", str(tmp_path), "--kv-capacity-tokens", "256"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    manifest = tmp_path / "services.json"
    deadline = time.monotonic() + 300
    while not manifest.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "crescent up did not come up"
        time.sleep(0.3)
    pids = [s["pid"] for s in json.loads(manifest.read_text())]
    assert len(pids) == 5 and all(process_alive(p) for p in pids)
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: the kernel must stop the children
    proc.wait()
    deadline = time.monotonic() + 20
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if process_alive(p)], "services outlived their launcher"
