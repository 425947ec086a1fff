"""Fixtures: kvstore nodes and an S3 server (moto) as real processes on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.ports import free_port  # noqa: F401  (re-exported for the tests here)


def wait_http(url: str, timeout_s: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s")


@dataclass
class Node:
    address: str
    admin: str
    proc: subprocess.Popen
    config: Path
    log: Path

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample on /metrics (0 when absent)."""
        text = httpx.get(f"{self.admin}/metrics", timeout=5).text
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_node(config: dict[str, Any], workdir: Path, name: str,
               module: str = "crescent.services.kvstore.server") -> Node:
    """``module``: what to run with ``-m`` (``tests.kvstore.ipc_node``: the stand-in GPU tier)."""
    port, admin = free_port(), free_port()
    config = {**config, "listen": {"host": "127.0.0.1", "port": port, "admin_port": admin}}
    config.setdefault("node_id", name)
    # The host arena is touched at start: keep it small unless a test sizes it.
    host = config.setdefault("tiers", {}).setdefault("host", {})
    host.setdefault("capacity_bytes", 32 << 20)
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = workdir / f"{name}.log"
    env = {**os.environ, "CRESCENT_LOG_LEVEL": "INFO"}
    env = {k: v for k, v in env.items() if not k.startswith("CRESCENT_KVSTORE")}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--config", str(path)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).resolve().parents[2],
    )
    node = Node(f"127.0.0.1:{port}", f"http://127.0.0.1:{admin}", proc, path, log)
    try:
        # torch (the stand-in's GPU tier) takes a while to import on a busy machine
        wait_http(f"{node.admin}/health", timeout_s=20.0 if module.startswith("crescent.") else 60.0, proc=proc)
    except Exception:
        node.stop()
        raise RuntimeError(f"kvstore {name} did not start:\n{log.read_text()[-3000:]}") from None
    return node


@pytest.fixture
def kvstore_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """Factory: ``kvstore_node(config_dict, name=...)`` starts a node; all stop at the end."""
    nodes: list[Node] = []

    def start(config: dict[str, Any] | None = None, name: str = "node-a", module: str | None = None) -> Node:
        node = start_node(config or {}, tmp_path, name, *([module] if module else []))
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.stop()


@dataclass
class S3Server:
    endpoint: str
    port: int
    proc: subprocess.Popen | None

    def start(self) -> None:
        exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
        self.proc = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_http(f"{self.endpoint}/moto-api/", proc=self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def s3_server() -> Iterator[S3Server]:
    """A fresh moto S3 server per test (state lives in its memory)."""
    port = free_port()
    server = S3Server(f"http://127.0.0.1:{port}", port, None)
    server.start()
    yield server
    server.stop()


def s3_config(server: S3Server, **extra: Any) -> dict[str, Any]:
    return {
        "enabled": True, "endpoint_url": server.endpoint, "bucket": "kv-test", "prefix": "blocks/",
        "region": "us-east-1", "access_key_id": "testing", "secret_access_key": "testing",
        "create_bucket": True, "timeout_s": 1.0, **extra,
    }
