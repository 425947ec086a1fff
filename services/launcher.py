"""``crescent up``: every service as its own OS process on this machine.

Picks free loopback ports, writes one YAML config per process into the run directory, starts
the processes, waits until each answers ``/health``, writes ``services.json`` (what runs where),
and stops them all on Ctrl-C or SIGTERM. Children get SIGTERM if this process dies, so a killed
launcher leaves no orphans.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """A service failed to start; the message includes the tail of its log."""


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    name: str            # unique, e.g. "prefill-0"
    service: str         # which `crescent serve` service
    config: dict[str, Any]
    grpc_address: str | None
    health_url: str
    metrics_url: str


@dataclass(frozen=True, slots=True)
class PlatformPlan:
    model: str
    host: str
    port: int
    prefill: int
    decode: int
    kv_capacity_tokens: int
    kvstore_capacity_bytes: int
    block_size: int
    ttft_slo_s: float | None = None

    def services(self) -> list[ServiceSpec]:
        host = self.host
        used: set[int] = {self.port}

        def port() -> int:
            while True:
                with socket.socket() as s:
                    s.bind((host, 0))
                    p = s.getsockname()[1]
                if p not in used:
                    used.add(p)
                    return p

        def listen() -> tuple[dict[str, Any], str, str]:
            grpc_port, admin_port = port(), port()
            return ({"host": host, "port": grpc_port, "admin_port": admin_port}, f"{host}:{grpc_port}",
                    f"http://{host}:{admin_port}")

        specs = []
        sched_listen, scheduler, sched_admin = listen()
        sched_config: dict[str, Any] = {"listen": sched_listen}
        if self.ttft_slo_s is not None:
            sched_config["slo"] = {"ttft_s": self.ttft_slo_s}
        specs.append(ServiceSpec("scheduler", "scheduler", sched_config, scheduler,
                                 f"{sched_admin}/health", f"{sched_admin}/metrics"))
        kv_listen, kvstore, kv_admin = listen()
        specs.append(ServiceSpec("kvstore", "kvstore", {
            "listen": kv_listen, "node_id": "kvstore-0", "scheduler_address": scheduler,
            "tiers": {"host": {"capacity_bytes": self.kvstore_capacity_bytes}},
        }, kvstore, f"{kv_admin}/health", f"{kv_admin}/metrics"))
        engine = {"model": self.model, "kv_capacity_tokens": self.kv_capacity_tokens, "block_size": self.block_size,
                  "threads": 2}
        for role, count in (("prefill", self.prefill), ("decode", self.decode)):
            for i in range(count):
                inst_listen, address, admin = listen()
                config = {"listen": inst_listen, "instance_id": f"{role}-{i}", "scheduler_address": scheduler,
                          "engine": engine}
                if role == "prefill":
                    config["kvstore_address"] = kvstore
                specs.append(ServiceSpec(f"{role}-{i}", role, config, address, f"{admin}/health", f"{admin}/metrics"))
        gateway = f"http://{host}:{self.port}"
        specs.append(ServiceSpec("gateway", "gateway", {
            "listen": {"host": host, "port": self.port}, "scheduler_address": scheduler, "model": self.model,
            "block_size": self.block_size,
        }, None, f"{gateway}/health", f"{gateway}/metrics"))
        return specs


def _die_with_parent() -> None:
    """Runs in the child before exec: ask the kernel for SIGTERM when the launcher dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: Ctrl-C and SIGTERM still stop the children through Platform.stop


class Platform:
    """The running processes of one ``crescent up``."""

    def __init__(self, plan: PlatformPlan, run_dir: Path) -> None:
        self.plan = plan
        self.run_dir = run_dir
        self.specs = plan.services()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def log_path(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        for spec in self.specs:
            config_path = self.run_dir / f"{spec.name}.yaml"
            config_path.write_text(yaml.safe_dump(spec.config, sort_keys=False))
            with open(self.log_path(spec.name), "wb") as log_file:
                self.procs[spec.name] = subprocess.Popen(
                    [sys.executable, "-m", "crescent.services.cli", "serve", spec.service, "--config", str(config_path)],
                    stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    preexec_fn=_die_with_parent,
                )

    def wait_ready(self, timeout_s: float, on_ready=lambda name: None) -> None:
        pending = {spec.name: spec for spec in self.specs}
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=1.0) as client:
            while pending:
                for name, spec in list(pending.items()):
                    self.check_alive(name)
                    try:
                        if client.get(spec.health_url).status_code == 200:
                            del pending[name]
                            on_ready(name)
                    except httpx.HTTPError:
                        pass
                if time.monotonic() > deadline:
                    raise LaunchError(f"not ready after {timeout_s:.0f} s: {', '.join(pending)} (logs in {self.run_dir})")
                time.sleep(0.2)
        self.write_manifest()

    def check_alive(self, name: str | None = None) -> None:
        for proc_name in [name] if name else list(self.procs):
            code = self.procs[proc_name].poll()
            if code is not None:
                tail = self.log_path(proc_name).read_text(errors="replace").splitlines()[-25:]
                raise LaunchError(f"{proc_name} exited with code {code}; last log lines:\n" + "\n".join(tail))

    def write_manifest(self) -> Path:
        manifest = [
            {"name": s.name, "role": s.service, "grpc": s.grpc_address, "metrics_url": s.metrics_url,
             "health_url": s.health_url, "log": str(self.log_path(s.name)), "pid": self.procs[s.name].pid}
            for s in self.specs
        ]
        path = self.run_dir / "services.json"
        path.write_text(json.dumps(manifest, indent=2))
        return path

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process (gateway first), then SIGKILL whatever is left after ``grace_s``."""
        for spec in reversed(self.specs):
            proc = self.procs.get(spec.name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
