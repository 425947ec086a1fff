"""A ``crescent up`` platform started as a user starts it, with the handles a fault test needs:
which process runs each service now, signals, health, and the KV a decode instance holds.

The launcher rewrites ``services.json`` when it restarts a service, so every lookup reads it
again; a pid is checked against the process's command line before it is signalled.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from crescent.protos import scheduler_pb2, scheduler_pb2_grpc
from crescent.services.model.model_source import DEFAULT_MODEL
from tests.admin_channel import admin_channel
from tests.ports import free_port

log = logging.getLogger(__name__)

CRESCENT = Path(sys.executable).with_name("crescent")
KV_USED = "crescent_engine_kv_used_tokens"
# Two engines per role share two cores: one torch thread each keeps them from fighting.
ONE_THREAD = {"CRESCENT_PREFILL__ENGINE__THREADS": "1", "CRESCENT_DECODE__ENGINE__THREADS": "1",
              # The scenarios' prompts include short ones whose prefix hits they count: keep every prompt's blocks.
              "CRESCENT_PREFILL__ENGINE__MIN_CACHED_PROMPT_TOKENS": "0"}


class StackError(RuntimeError):
    """The platform did not start, or did not come back to health in time (with log tails)."""


@dataclass(frozen=True, slots=True)
class StackPlan:
    prefill: int = 2
    decode: int = 2
    kv_capacity_tokens: int = 4096
    kvstore_gb: float = 0.3
    # What a drained service's streams get to finish: the launcher's default, 30 s, did not cover
    # six 128-token streams on a 2-core machine under load (they were cut at 106 tokens).
    drain_grace_s: float = 90.0
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def args(self) -> list[str]:
        return ["--prefill", str(self.prefill), "--decode", str(self.decode),
                "--kv-capacity-tokens", str(self.kv_capacity_tokens), "--kvstore-gb", str(self.kvstore_gb),
                "--drain-grace", str(self.drain_grace_s), *self.extra_args]


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


class FaultStack:
    """One running ``crescent up`` (``start``), stopped with SIGTERM as Ctrl-C would (``stop``)."""

    def __init__(self, plan: StackPlan, run_dir: Path, port: int, proc: subprocess.Popen[bytes]) -> None:
        self.plan = plan
        self.run_dir = run_dir
        self.port = port
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.model = DEFAULT_MODEL

    @classmethod
    def start(cls, run_dir: Path, plan: StackPlan = StackPlan(), timeout_s: float = 300) -> FaultStack:
        port = free_port()
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "up.log", "wb") as out:
            proc = subprocess.Popen(
                [str(CRESCENT), "up", "--run-dir", str(run_dir), "--port", str(port), *plan.args()],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **ONE_THREAD, **plan.env},
            )
        stack = cls(plan, run_dir, port, proc)
        deadline = time.monotonic() + timeout_s
        while not (run_dir / "services.json").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                stack.kill_all()
                raise StackError("crescent up did not start:\n" + stack.log_tail("up"))
            time.sleep(0.3)
        try:
            stack.wait_healthy(timeout_s)
        except StackError:
            stack.stop()
            raise
        return stack

    # -- what runs where --------------------------------------------------------------------

    def services(self) -> list[dict]:
        for _ in range(20):  # the launcher may be rewriting it
            try:
                return json.loads((self.run_dir / "services.json").read_text())
            except (json.JSONDecodeError, FileNotFoundError):
                time.sleep(0.05)
        raise StackError(f"cannot read {self.run_dir / 'services.json'}")

    def service(self, name: str) -> dict:
        return next(s for s in self.services() if s["name"] == name)

    def names(self, role: str) -> list[str]:
        return [s["name"] for s in self.services() if s["role"] == role]

    def pid(self, name: str) -> int | None:
        """The live process running ``name`` now, or None: services.json's pid when its command
        line is that service's, otherwise the process started with its config file."""
        config = f"--config {self.run_dir / (name + '.yaml')}"
        pid = self.service(name).get("pid")
        if pid and process_alive(pid) and config in _cmdline(pid):
            return pid
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and config in _cmdline(int(entry.name)) and process_alive(int(entry.name)):
                return int(entry.name)
        return None

    def signal(self, name: str, sig: signal.Signals) -> int:
        pid = self.pid(name)
        if pid is None:
            raise StackError(f"{name} is not running; cannot send {sig.name}")
        log.info("sending %s to %s (pid %d)", sig.name, name, pid)
        os.kill(pid, sig)
        return pid

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.run_dir / f"{name}.log"
        if not path.exists():
            return f"({path} does not exist)"
        return f"--- {path} ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # -- health ---------------------------------------------------------------------------------

    def health(self, name: str) -> tuple[int | None, dict]:
        """(status, body) of a service's /health; (None, {}) when nothing answers."""
        try:
            r = httpx.get(self.service(name)["health_url"], timeout=2)
        except httpx.HTTPError:
            return None, {}
        try:
            body = r.json()
        except ValueError:
            body = {}
        return r.status_code, body

    def unhealthy(self) -> list[str]:
        """Services not answering 200 now, and a gateway that does not see every engine."""
        bad = [s["name"] for s in self.services() if self.health(s["name"])[0] != 200]
        if "gateway" not in bad:
            _, body = self.health("gateway")
            wanted = {"prefill_instances": self.plan.prefill, "decode_instances": self.plan.decode}
            bad += [f"gateway sees {body.get(k)} {k}" for k, n in wanted.items() if k in body and body[k] != n]
        return bad

    def request_succeeds(self) -> bool:
        body = {"model": self.model, "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": "Are you there?"}]}
        try:
            return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float = 120) -> float:
        """Seconds until every service answers 200, the gateway sees every engine and a request succeeds."""
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise StackError(f"crescent up exited ({self.proc.returncode}):\n{self.log_tail('up')}")
            bad = self.unhealthy()
            if not bad and self.request_succeeds():
                return time.monotonic() - start
            if time.monotonic() > deadline:
                tails = "\n".join(self.log_tail(n.split()[0]) for n in bad[:3])
                raise StackError(f"not healthy after {timeout_s:.0f} s: {bad}\n{self.log_tail('up')}\n{tails}")
            time.sleep(0.25)

    # -- KV held by decode ---------------------------------------------------------------------

    def metric(self, name: str, metric: str, label: str = "") -> float | None:
        """Sum of one metric's samples (those whose labels contain ``label``, e.g.
        ``stage="mid_stream"``) on a service's /metrics; None when it does not answer."""
        try:
            text = httpx.get(self.service(name)["metrics_url"], timeout=2).text
        except httpx.HTTPError:
            return None
        total = 0.0
        for line in text.splitlines():
            if line.startswith(metric) and line[len(metric):len(metric) + 1] in ("{", " ") and label in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def decode_kv_used(self) -> dict[str, float | None]:
        return {name: self.metric(name, KV_USED) for name in self.names("decode")}

    def wait_kv_freed(self, since: float, timeout_s: float, poll_s: float = 0.05) -> float | None:
        """Seconds from ``since`` (monotonic) until every live decode instance reports no KV in
        use; None if that did not happen within ``timeout_s``."""
        while time.monotonic() < since + timeout_s:
            used = self.decode_kv_used()
            if all(v == 0 for v in used.values() if v is not None):
                return time.monotonic() - since
            time.sleep(poll_s)
        log.warning("decode KV still in use: %s", self.decode_kv_used())
        return None

    def scheduler_free_kv(self) -> dict[str, int]:
        """free_kv_tokens of each decode instance as the scheduler sees it (ListInstances)."""
        address = self.service("scheduler")["grpc"]
        with admin_channel(self.run_dir, address) as channel:
            reply = scheduler_pb2_grpc.SchedulerStub(channel).ListInstances(
                scheduler_pb2.ListInstancesRequest(), timeout=2)
        return {s.info.instance_id: s.load.free_kv_tokens for s in reply.instances
                if s.info.role == scheduler_pb2.INSTANCE_ROLE_DECODE}

    # -- stopping --------------------------------------------------------------------------------

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM to ``crescent up``, as Ctrl-C would; whatever is left afterwards is killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.error("crescent up did not stop within %.0f s; killing it", timeout_s)
        self.kill_all()

    def kill_all(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if (self.run_dir / "services.json").exists():
            for s in self.services():
                pid = self.pid(s["name"])
                if pid is not None:
                    log.error("%s (pid %d) outlived crescent up; killing it", s["name"], pid)
                    os.kill(pid, signal.SIGKILL)
