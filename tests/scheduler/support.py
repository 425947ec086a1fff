"""Helpers for the scheduler tests: a real scheduler process and instance descriptions."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx

from crescent.protos import scheduler_pb2, scheduler_pb2_grpc

from tests.ports import free_port  # noqa: F401  (re-exported for the tests here)

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # loadtest/ is not an installed package
    sys.path.insert(0, str(REPO_ROOT))


class SchedulerProcess:
    """``crescent serve scheduler`` as the CLI runs it: ``server.main(config)`` in its own process."""

    def __init__(self, config_path: Path, port: int, admin_port: int) -> None:
        self.config_path = config_path
        self.port = port
        self.admin_port = admin_port
        self.address = f"127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None
        self.stub: scheduler_pb2_grpc.SchedulerStub | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        code = "import sys; from pathlib import Path; from crescent.services.scheduler.server import main; main(Path(sys.argv[1]))"
        env = dict(os.environ, CRESCENT_LOG_LEVEL="WARNING")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(self.config_path)], env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"scheduler exited with {self.proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.admin_port}/health", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        else:
            raise TimeoutError("scheduler did not become healthy")
        self.channel = grpc.insecure_channel(self.address)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.admin_port}/metrics", timeout=2).text


def instance(instance_id: str, role: str, *, model_id: str = "m", block_size: int = 4, kv_capacity_tokens: int = 100_000,
             max_batch_size: int = 16, kv_format: str = "", kv_dtype: str = "") -> scheduler_pb2.InstanceInfo:
    roles = {"prefill": scheduler_pb2.INSTANCE_ROLE_PREFILL, "decode": scheduler_pb2.INSTANCE_ROLE_DECODE,
             "kvstore": scheduler_pb2.INSTANCE_ROLE_KVSTORE}
    return scheduler_pb2.InstanceInfo(
        instance_id=instance_id, role=roles[role], address=f"{instance_id}.local:7000",
        model_id=model_id, block_size=block_size, kv_capacity_tokens=kv_capacity_tokens, max_batch_size=max_batch_size,
        kv_format=kv_format, kv_dtype=kv_dtype,
    )
