"""Helpers for the gateway tests: real processes on 127.0.0.1, started and stopped by fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import httpx
import yaml

from tests.ports import free_port  # noqa: F401  (re-exported for the tests here)

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 4  # small, so short test prompts have full blocks
SALT_SECRET = "gateway-tests-cache-salt-secret"


def served_salt(client_salt: str | None = None, tenant_id: str = "default") -> bytes:
    """The cache salt a test gateway derives for ``tenant_id``'s request with ``client_salt``."""
    from crescent.services.tenancy import cache_salt, tenant_salt

    return cache_salt(tenant_salt(SALT_SECRET.encode(), tenant_id), client_salt)


def answers(ready_url: str, expect_status: int | None, timeout_s: float, still_running: Callable[[], None],
            *, interval_s: float) -> bool:
    """Poll ``ready_url`` until it answers (with ``expect_status`` unless None): True, or False
    after ``timeout_s``. ``still_running`` raises when the server stopped, ending the wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        still_running()
        try:
            status = httpx.get(ready_url, timeout=0.5).status_code
            if expect_status is None or status == expect_status:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return False


class Process:
    """A child Python process started from the repository root."""

    def __init__(self, name: str, *args: str) -> None:
        self.name = name
        self.argv = [sys.executable, *args]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_url: str, *, expect_status: int | None = 200, timeout_s: float = 20.0) -> None:
        """Start, then poll ``ready_url`` until it answers (with ``expect_status`` unless None)."""
        self.spawn()
        self.wait_ready(ready_url, expect_status=expect_status, timeout_s=timeout_s)

    def spawn(self) -> None:
        env = dict(os.environ, CRESCENT_LOG_LEVEL="WARNING")
        self.proc = subprocess.Popen(self.argv, cwd=REPO_ROOT, env=env)

    def wait_ready(self, ready_url: str, *, expect_status: int | None = 200, timeout_s: float = 20.0) -> None:
        assert self.proc is not None, "spawn first"
        proc = self.proc

        def still_running() -> None:
            if proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {proc.returncode}")

        if not answers(ready_url, expect_status, timeout_s, still_running, interval_s=0.05):
            self.stop()
            raise TimeoutError(f"{self.name} did not become ready at {ready_url}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM, then wait; returns the exit code (SIGKILL after 10 s, which fails the caller's check)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code, self.proc = self.proc.returncode, None
        return code


class FakeBackend(Process):
    def __init__(self) -> None:
        self.port, self.control_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.control = f"http://127.0.0.1:{self.control_port}"
        super().__init__(
            "fake backend", "-m", "tests.gateway.fake_backend",
            "--port", str(self.port), "--control-port", str(self.control_port), "--block-size", str(BLOCK_SIZE),
        )

    def start_backend(self) -> None:
        self.start(f"{self.control}/places")

    def get(self, path: str) -> Any:
        return httpx.get(f"{self.control}{path}", timeout=5).json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return httpx.post(f"{self.control}{path}", json=body, timeout=5).json()

    def put(self, path: str, body: dict[str, Any]) -> Any:
        return httpx.put(f"{self.control}{path}", json=body, timeout=5).json()


# What ``crescent serve gateway --config FILE`` runs.
PRODUCTION_ENTRY = ("-c", "import sys; from pathlib import Path; from crescent.services.gateway.server import main; "
                    "main(Path(sys.argv[1]))")
FAKE_TOKENIZER_ENTRY = ("-m", "tests.gateway.run_gateway")


class Gateway(Process):
    """The gateway process; by default with the fake tokenizer (``run_gateway``)."""

    def __init__(self, config_dir: Path, scheduler_address: str, *, entry: tuple[str, ...] = FAKE_TOKENIZER_ENTRY,
                 **settings: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "listen": {"host": "127.0.0.1", "port": self.port},
            "scheduler_address": scheduler_address,  # no block size: learned from the scheduler
            "log_level": "WARNING",
            "responses_db": ":memory:",  # stored responses never outlive the test's gateway
            **settings,
        }
        # Tenants, keys and the salt secret: the test's own database, never the user's ~/.cache one.
        # A known salt secret, so tests can compute the block keys the gateway sends.
        config["auth"] = {"database_url": f"sqlite:///{config_dir}/tenancy-{self.port}.sqlite3",
                          "cache_salt_secret": SALT_SECRET, **settings.get("auth", {})}
        path = config_dir / f"gateway-{self.port}.yaml"
        path.write_text(yaml.safe_dump(config))
        super().__init__("gateway", *entry, str(path))

    def start_gateway(self, *, healthy: bool = True, timeout_s: float = 20.0) -> None:
        self.spawn()
        self.wait_gateway(healthy=healthy, timeout_s=timeout_s)

    def wait_gateway(self, *, healthy: bool = True, timeout_s: float = 20.0) -> None:
        self.wait_ready(f"{self.url}/health", expect_status=200 if healthy else None, timeout_s=timeout_s)
