"""Real processes on loopback for the vLLM backend's tests: scheduler, kvstore and gateway from
this interpreter, vLLM-backed aggregated instances and a standalone vLLM server from the vLLM
venv (``make install-vllm``). Started by hand rather than through ``crescent up`` so a test can
stop, kill or add one engine instance while the rest keeps running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from crescent.services.engine_vllm.interpreter import VllmNotInstalledError, vllm_python
from tests.ports import free_port

VLLM_START_S = 900  # vLLM's CPU start (load, profile, compile) takes 100-300 s on 2 busy cores


def vllm_interpreter() -> str | None:
    try:
        return vllm_python()
    except VllmNotInstalledError:
        return None


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    grpc: str = ""
    health: str = ""
    config: dict = field(default_factory=dict)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


def listen() -> dict:
    return {"host": "127.0.0.1", "port": free_port(), "admin_port": free_port()}


def start_service(run_dir: Path, name: str, service: str, config: dict, python: str = sys.executable,
                  env: dict[str, str] | None = None) -> Service:
    path = run_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = run_dir / f"{name}.log"
    proc = subprocess.Popen([python, "-m", "crescent.services.cli", "serve", service, "--config", str(path)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "CRESCENT_LOG_LEVEL": "INFO", **(env or {})})
    lst = config.get("listen", {})
    grpc_address = f"127.0.0.1:{lst['port']}" if "admin_port" in lst else ""
    health = f"http://127.0.0.1:{lst['admin_port']}/health" if "admin_port" in lst else f"http://127.0.0.1:{lst['port']}/health"
    return Service(name, proc, log, grpc_address, health, config)


def start_peer(run_dir: Path, python: str, model_dir: Path, served_name: str, block_size: int) -> tuple[Service, str]:
    """Standalone vLLM (its own OpenAI server) on the same weights: what Crescent-over-vLLM must equal."""
    port = free_port()
    log = run_dir / "peer-vllm.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "VLLM_CACHE_ROOT": str(run_dir / "peer-cache"), "TORCHINDUCTOR_CACHE_DIR": str(run_dir / "peer-inductor")}
    proc = subprocess.Popen(
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
         served_name, "--dtype", "float32", "--block-size", str(block_size), "--max-model-len", "8192",
         "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    return Service("peer-vllm", proc, log, health=f"{url}/health"), url


def wait_healthy(services: list[Service], timeout_s: float) -> None:
    """Every service answers 200 on its health URL (or the test fails with the log of the one that died)."""
    deadline = time.monotonic() + timeout_s
    waiting = list(services)
    while waiting:
        for service in list(waiting):
            if service.proc.poll() is not None:
                raise RuntimeError(f"{service.name} exited {service.proc.returncode}:\n{service.log_tail()}")
            try:
                if httpx.get(service.health, timeout=2).status_code == 200:
                    waiting.remove(service)
            except httpx.HTTPError:
                pass
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(s.name for s in waiting)} not healthy after {timeout_s:g} s:\n"
                               + waiting[0].log_tail())
        time.sleep(0.5)
