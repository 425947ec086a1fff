"""``crescent up``: every service as its own OS process on this machine, kept running.

Picks free loopback ports, writes one YAML config per process into the run directory, starts
the processes, waits until each answers ``/health``, writes ``services.json`` (what runs where),
and supervises them: a service that exits without being asked to is restarted from the same
config (so on the same ports) after an exponential backoff, and the others keep serving. Ctrl-C
or SIGTERM drains them: the request path first (gateway, prefill, decode get SIGTERM and their
drain grace), then the scheduler and the kvstore; SIGKILL for whatever outlives its grace.
Children get SIGTERM if this process dies, so a killed launcher leaves no orphans.

Internal gRPC is mutual TLS (docs/security.md): the launcher makes a throwaway CA and one
certificate per process in ``<run dir>/tls`` (keys 0600), plus ``admin.pem`` for operators'
debug tools (``admin_tls``), and points every service at its files. The CA's key is deleted once
they are issued, and every private key when the platform stops.

``--engine vllm`` (``PlatformPlan.backend``): every engine's config asks for the vLLM backend
(``engine.backend: vllm``) and those processes run on the vLLM venv's Python
(services/engine_vllm/interpreter.py); the other services on this one. Aggregated instances by
default; with pools, a vLLM decode reads its handoffs from the kvstore (services/engine_vllm/handoff.py).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml

from crescent.services.common.certs import LOCAL_HOSTS, make_pki
from crescent.services.common.ports import unused_port
from crescent.services.common.tls import PeerTls, TlsSettings, is_loopback, load_tls
from crescent.services.contract.roles import settings_class
from crescent.services.cpu_share import available_cores, share_cores
from crescent.services.engine_vllm.interpreter import vllm_python

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
REQUEST_PATH = ("gateway", "prefill", "decode", "aggregated")  # drained first: they finish in-flight streams
# Decode drains only once prefill has: a draining decode refuses new handoffs, and a prompt that
# prefill is still working on when the stop comes must find its decode instance open.
DRAINS_AFTER_PREFILL = ("decode",)
BACKEND_GRACE_S = 10.0  # scheduler and kvstore: nothing in flight to finish
KILL_MARGIN_S = 5.0  # past a service's own drain grace before SIGKILL
EngineBackend = Literal["native", "vllm"]
BACKENDS: tuple[EngineBackend, ...] = ("native", "vllm")
# How long `crescent up` waits for every service by default: vLLM's CPU build takes 100-190 s to
# start one engine on 2 cores (torch.compile, KV cache allocation), more when engines share them.
READY_TIMEOUT_S: dict[str, float] = {"native": 600.0, "vllm": 900.0}


class LaunchError(RuntimeError):
    """A service failed to start; the message includes the tail of its log."""


class StopRequested(Exception):
    """Ctrl-C or SIGTERM arrived while the platform was starting."""


class PlanError(ValueError):
    """A ``crescent up`` plan that cannot run (said before anything starts)."""


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    name: str            # unique, e.g. "prefill-0"
    service: str         # which `crescent serve` service
    config: dict[str, Any]
    grpc_address: str | None
    health_url: str
    metrics_url: str
    env: dict[str, str] = field(default_factory=dict)  # added to the process's environment


def child_env(spec: ServiceSpec) -> dict[str, str]:
    """A service process's environment: this one's, then the launcher's defaults, then the spec's.
    A vLLM-backed engine finds its own venv's programs first on the PATH (ninja, the compilers'
    wrappers vLLM and torch.compile look up), not those of the venv the launcher runs in."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           **spec.env}
    if backend_of(spec.config) == "vllm":
        bin_dir = os.path.dirname(interpreter(spec))
        env["PATH"] = os.pathsep.join(p for p in (bin_dir, env.get("PATH", "")) if p)
        if os.path.exists(os.path.join(bin_dir, "..", "pyvenv.cfg")):
            env["VIRTUAL_ENV"] = os.path.dirname(bin_dir)
        else:
            env.pop("VIRTUAL_ENV", None)
    return env


def _drain_setting(service: str, grace_s: float) -> dict[str, Any]:
    """``drain_grace_s`` where this service's settings take it: at the top (gateway) or in its
    engine's settings (prefill, decode); nothing where it has none (an unknown key would fail
    the settings' validation)."""
    fields = settings_class(service).model_fields
    if "drain_grace_s" in fields:
        return {"drain_grace_s": grace_s}
    engine = fields.get("engine")
    if engine is not None and "drain_grace_s" in getattr(engine.annotation, "model_fields", {}):
        return {"engine": {"drain_grace_s": grace_s}}
    return {}


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
    drain_grace_s: float = 30.0
    tls: bool = True  # mutual TLS between the services (off: plaintext, loopback only)
    cores: int | None = None  # cores the engines share (None: this process's affinity mask)
    aggregated: int = 0  # > 0: this many aggregated engines (prefill and decode in one) instead of the two pools
    backend: EngineBackend = "native"  # what computes in every engine: Crescent's engine or vLLM (its own venv)
    unauthenticated_network: bool = False  # a keyless gateway on a non-loopback host, said in so many words
    device: str = "cpu"  # native engines: engine.device (cpu, cuda, cuda:N)
    dtype: str = "auto"  # native engines: engine.dtype
    kv_cache_dtype: str = "auto"  # native engines: engine.kv_cache_dtype

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise PlanError(f"unknown engine backend {self.backend!r}; choose {' or '.join(BACKENDS)}")
        if self.backend != "native" and (asked := self.engine_options()):
            given = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in asked.items())
            raise PlanError(f"{given}: these set the native engine; vLLM takes its own (crescent up runs vLLM's "
                            "CPU build in float32)")
        if not is_loopback(self.host) and not self.unauthenticated_network:
            raise PlanError(f"--host {self.host}: the gateway would serve without API keys where other hosts reach it "
                            "(crescent up runs with auth off). Bind 127.0.0.1, or add --allow-unauthenticated-network "
                            "on a network you trust.")

    def engine_options(self) -> dict[str, str]:
        """The engine.device / dtype / kv_cache_dtype settings asked for (those not at their default)."""
        asked = {"device": self.device, "dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype}
        return {key: value for key, value in asked.items() if value != ("cpu" if key == "device" else "auto")}

    def services(self) -> list[ServiceSpec]:
        host = self.host
        used: set[int] = {self.port}

        def port() -> int:
            return unused_port(host, used)

        def listen() -> tuple[dict[str, Any], str, str]:
            # /health and /metrics stay on loopback whatever --host says: only this machine's
            # operator (and its Prometheus) reads them.
            grpc_port, admin_port = port(), port()
            return ({"host": host, "port": grpc_port, "admin_port": admin_port, "admin_host": LOOPBACK},
                    f"{host}:{grpc_port}", f"http://{LOOPBACK}:{admin_port}")


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
        engine: dict[str, Any] = {"model": self.model, "kv_capacity_tokens": self.kv_capacity_tokens,
                                  "block_size": self.block_size}
        if self.backend == "native":
            engine |= self.engine_options()  # checked by each engine at start-up (and by check_engine_settings)
        if self.backend == "vllm":
            # vLLM's CPU build (the .venv-vllm one crescent up uses): float32, which is the fast
            # dtype on CPUs without AVX-512 bf16 and comparable with the native engine.
            engine = {"backend": "vllm", **engine, "vllm": {"dtype": "float32"}}
        pools = (("aggregated", self.aggregated),) if self.aggregated else (("prefill", self.prefill), ("decode", self.decode))
        threads = share_cores(self.cores or available_cores(), *(count for _, count in pools))
        for role, count in pools:
            for i in range(count):
                inst_listen, address, admin = listen()
                drain = _drain_setting(role, self.drain_grace_s)
                config = {"listen": inst_listen, "instance_id": f"{role}-{i}", "scheduler_address": scheduler,
                          **drain, "engine": {**engine, "threads": threads.threads(role), **drain.get("engine", {})}}
                if role in ("prefill", "aggregated") or self.backend == "vllm":  # vLLM decode loads handoffs from it
                    config["kvstore_address"] = kvstore
                specs.append(ServiceSpec(f"{role}-{i}", role, config, address, f"{admin}/health", f"{admin}/metrics",
                                         env=threads.env(role)))
        gateway = f"http://{host}:{self.port}"
        specs.append(ServiceSpec("gateway", "gateway", {
            # No block size: the gateway learns it from the engines through the scheduler.
            "listen": {"host": host, "port": self.port}, "scheduler_address": scheduler, "model": self.model,
            **({"auth": {"allow_unauthenticated_network": True}} if self.unauthenticated_network else {}),
            **_drain_setting("gateway", self.drain_grace_s),
        }, None, f"{gateway}/health", f"{gateway}/metrics"))
        return specs


def check_engine_settings(plan: PlatformPlan) -> None:
    """Say once, before anything starts, what every native engine of ``plan`` would refuse at
    start-up (and restart into again and again): settings its settings model (``EngineSettings``)
    refuses, a CUDA device this machine lacks, an fp8 cache for a model that has no MLA latents, a
    block size the CUDA attention kernels cannot take.
    Raises PlanError, DeviceSettingError or ModelSpecError; each names the setting."""
    if plan.backend != "native":
        return
    from pydantic import ValidationError

    from crescent.services.engine.device import check_block_size_fits, check_cache_dtype_fits, resolve_device
    from crescent.services.engine.settings import EngineSettings
    from crescent.services.model.model_source import resolve_model

    resolve_device(plan.device)  # first: its message says what this machine has
    try:
        settings = EngineSettings(model=plan.model, kv_capacity_tokens=plan.kv_capacity_tokens,
                                  block_size=plan.block_size, **plan.engine_options())
    except ValidationError as exc:
        raise PlanError("; ".join(f"engine.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None
    if settings.kv_cache_dtype != "fp8" and not settings.device.startswith("cuda"):
        return  # no rule below depends on the model's family: its files are not looked up
    kind = resolve_model(plan.model).kind
    check_cache_dtype_fits(settings.kv_cache_dtype, plan.model, kind, option=" (--kv-cache-dtype)")
    check_block_size_fits(settings.device, settings.block_size, kind, option=" (--block-size)")


TLS_DIR = "tls"
LOOPBACK = "127.0.0.1"
ADMIN = "admin"
GATEWAY_TLS_ENV = "CRESCENT_GATEWAY_TLS"  # the gateway's settings take TLS from the environment


def _identity(spec: ServiceSpec) -> str:
    """The name in a process's certificate: the id it registers with, where it has one."""
    return str(spec.config.get("instance_id") or spec.config.get("node_id") or spec.name)


def with_tls(specs: list[ServiceSpec], directory: Path, host: str) -> list[ServiceSpec]:
    """``specs`` configured for mutual TLS with a new CA and a certificate per process in
    ``directory`` (and one for the ``admin`` role)."""
    holders = [(spec.service, _identity(spec)) for spec in specs] + [(ADMIN, ADMIN)]
    issued = make_pki(directory, holders, hosts=(*LOCAL_HOSTS, host))
    # Nothing here issues more (a restart reuses its files), and any process that could read the
    # CA key could mint a certificate for any role: it does not outlive the issuing.
    (directory / "ca-key.pem").unlink()
    secured = []
    for spec in specs:
        files = issued[(spec.service, _identity(spec))].settings()
        if spec.service == "gateway":
            env = {f"{GATEWAY_TLS_ENV}__{key.upper()}": value for key, value in files.items()}
            secured.append(replace(spec, env={**spec.env, **env}))
        else:
            secured.append(replace(spec, config={**spec.config, "tls": files}))
    return secured


def admin_tls(run_dir: Path) -> PeerTls | None:
    """The ``admin`` key pair of a ``crescent up`` run (None if it runs plaintext), for debug
    tools: ``open_channel(address, admin_tls(run_dir))``."""
    directory = run_dir / TLS_DIR
    if not (directory / "ca.pem").exists():
        return None
    return load_tls(TlsSettings(ca=str(directory / "ca.pem"), cert=str(directory / f"{ADMIN}.pem"),
                                key=str(directory / f"{ADMIN}-key.pem")))


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before restart number ``n`` of a run of crashes: ``initial_s`` doubling up to
    ``max_s``. A service that stayed up ``reset_after_s`` starts a new run."""

    initial_s: float = 0.5
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def delay(self, crashes_in_a_row: int) -> float:
        return min(self.max_s, self.initial_s * 2 ** max(0, crashes_in_a_row - 1))


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(frozen=True, slots=True)
class SupervisionEvent:
    """What the launcher tells its operator: a crash (with the log's last lines), a restart, or a
    restarted service answering ``/health`` again."""

    kind: Literal["crashed", "exited", "restarted", "ready", "restart_failed"]  # exited: code 0, unasked
    name: str
    detail: str
    log_tail: tuple[str, ...] = ()


@dataclass
class _Child:
    spec: ServiceSpec
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    crashes_in_a_row: int = 0
    restarts: int = 0
    restart_at: float | None = None  # set while it is down and waiting for its backoff
    awaiting_health: bool = False
    last_health_check: float = 0.0


def backend_of(config: dict[str, Any]) -> str:
    """Which engine backend a service's config asks for ('native' for services without an engine)."""
    engine = config.get("engine")
    return str(engine.get("backend", "native")) if isinstance(engine, dict) else "native"


def interpreter(spec: ServiceSpec) -> str:
    """The Python a service runs on: a vLLM-backed engine on the one with vLLM (its own venv,
    services/engine_vllm/interpreter.py), everything else on this one. Raises
    ``VllmNotInstalledError`` when vLLM is needed and absent."""
    return vllm_python() if backend_of(spec.config) == "vllm" else sys.executable


def _die_with_parent() -> None:
    """Runs in the child before exec: ask the kernel for SIGTERM when the launcher dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: Ctrl-C and SIGTERM still stop the children through Platform.stop


@dataclass
class Platform:
    """The running processes of one ``crescent up``."""

    plan: PlatformPlan
    run_dir: Path
    backoff: Backoff = Backoff()
    clock: Callable[[], float] = time.monotonic
    specs: list[ServiceSpec] = field(init=False)
    children: dict[str, _Child] = field(init=False)
    stop_requested: bool = field(default=False, init=False)
    force_stop: bool = field(default=False, init=False)  # a second Ctrl-C: SIGKILL, no more grace

    def __post_init__(self) -> None:
        self.specs = self.plan.services()
        for spec in self.specs:  # a missing vLLM venv is said now, before anything is made or started
            interpreter(spec)
        if self.plan.tls:
            self.specs = with_tls(self.specs, self.run_dir / TLS_DIR, self.plan.host)
        for spec in self.specs:
            if spec.service == "gateway":  # a restarted gateway commits the usage rows its last life journaled
                spec.config.setdefault("ledger", {})["journal_dir"] = str(self.run_dir / "ledger-journal")
        self.children = {spec.name: _Child(spec) for spec in self.specs}

    @property
    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        return {name: c.proc for name, c in self.children.items() if c.proc is not None}

    def log_path(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    def log_tail(self, name: str, lines: int = 25) -> list[str]:
        """The last lines of a service's log (read from its end: logs of long runs are big)."""
        try:
            with open(self.log_path(name), "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
                return f.read().decode(errors="replace").splitlines()[-lines:]
        except OSError:
            return []

    def request_stop(self) -> None:
        """From a signal handler: the first call asks for a drain, the second for SIGKILL."""
        self.force_stop = self.stop_requested
        self.stop_requested = True

    def command(self, spec: ServiceSpec, config_path: Path) -> list[str]:
        return [interpreter(spec), "-m", "crescent.services.cli", "serve", spec.service, "--config", str(config_path)]

    def _spawn(self, child: _Child) -> None:
        """Start (or restart) one service from its config, rewritten, so on the same ports."""
        spec = child.spec
        env = child_env(spec)
        config_path = self.run_dir / f"{spec.name}.yaml"
        config_path.write_text(yaml.safe_dump(spec.config, sort_keys=False))
        with open(self.log_path(spec.name), "ab") as log_file:  # a restart keeps the log of the crash
            if child.restarts:
                log_file.write(f"\n--- crescent up: restart {child.restarts} ---\n".encode())
                log_file.flush()
            # A session of its own: Ctrl-C in the terminal reaches only the launcher, which then
            # drains the services in order instead of all of them stopping at once.
            child.proc = subprocess.Popen(
                self.command(spec, config_path), stdout=log_file, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent, start_new_session=True,
            )
        child.started_at = self.clock()

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for child in self.children.values():
            self.log_path(child.spec.name).unlink(missing_ok=True)
            self._spawn(child)

    def wait_ready(self, timeout_s: float, on_ready: Callable[[str], None] = lambda name: None) -> None:
        pending = {spec.name: spec for spec in self.specs}
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=1.0) as client:
            while pending:
                for name, spec in list(pending.items()):
                    if self.stop_requested:
                        raise StopRequested
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
        """While starting: a service that exits is a launch failure, not something to retry."""
        for proc_name in [name] if name else list(self.children):
            proc = self.children[proc_name].proc
            code = proc.poll() if proc is not None else None
            if code is not None:
                tail = self.log_tail(proc_name)
                raise LaunchError(f"{proc_name} exited ({describe_exit(code)}); last log lines:\n" + "\n".join(tail))

    def write_manifest(self) -> Path:
        manifest = []
        for s in self.specs:
            child = self.children[s.name]
            manifest.append({
                "name": s.name, "role": s.service, "grpc": s.grpc_address, "metrics_url": s.metrics_url,
                "health_url": s.health_url, "log": str(self.log_path(s.name)),
                "pid": child.proc.pid if child.proc is not None else None,  # None: waiting to be restarted
                "restarts": child.restarts,
            })
        path = self.run_dir / "services.json"
        tmp = path.with_suffix(".json.tmp")  # readers never see half a file
        tmp.write_text(json.dumps(manifest, indent=2))
        tmp.replace(path)
        return path

    # -- supervision ----------------------------------------------------------------------

    def supervise(self) -> list[SupervisionEvent]:
        """One pass: note crashes, restart what is due, check restarted services' health."""
        events: list[SupervisionEvent] = []
        now = self.clock()
        for child in self.children.values():
            if child.restart_at is None:
                code = child.proc.poll() if child.proc is not None else None
                if code is not None:
                    events.append(self._went_down(child, code, now))
            elif now >= child.restart_at:
                events.append(self._restart(child))
        for child in self.children.values():
            if child.awaiting_health and child.restart_at is None and now - child.last_health_check >= 0.5:
                child.last_health_check = now
                if self._healthy(child.spec):
                    child.awaiting_health = False
                    events.append(SupervisionEvent("ready", child.spec.name, "answers /health again"))
        return events

    def _went_down(self, child: _Child, code: int, now: float) -> SupervisionEvent:
        up_s = now - child.started_at
        if up_s >= self.backoff.reset_after_s:
            child.crashes_in_a_row = 0
        child.crashes_in_a_row += 1
        delay = self.backoff.delay(child.crashes_in_a_row)
        child.restart_at = now + delay
        child.awaiting_health = False
        in_a_row = f", {child.crashes_in_a_row} crashes in a row" if child.crashes_in_a_row > 1 else ""
        detail = f"{describe_exit(code)} after {up_s:.1f} s up{in_a_row}; restarting in {delay:.1f} s"
        kind: Literal["crashed", "exited"] = "exited" if code == 0 else "crashed"  # e.g. someone sent it SIGTERM
        return SupervisionEvent(kind, child.spec.name, detail, tuple(self.log_tail(child.spec.name, 10)))

    def _restart(self, child: _Child) -> SupervisionEvent:
        child.restart_at = None
        child.restarts += 1
        try:
            self._spawn(child)
        except OSError as exc:  # e.g. out of processes: counts as another crash
            child.proc = None
            child.crashes_in_a_row += 1
            delay = self.backoff.delay(child.crashes_in_a_row)
            child.restart_at = self.clock() + delay
            return SupervisionEvent("restart_failed", child.spec.name, f"{exc}; next try in {delay:.1f} s")
        child.awaiting_health = True
        try:
            self.write_manifest()
        except OSError as exc:  # e.g. a full disk: the service runs anyway, only the listing is stale
            log.warning("cannot update services.json: %s", exc)
        assert child.proc is not None
        return SupervisionEvent("restarted", child.spec.name, f"pid {child.proc.pid} (restart {child.restarts})")

    @staticmethod
    def _healthy(spec: ServiceSpec) -> bool:
        try:
            return httpx.get(spec.health_url, timeout=0.3).status_code == 200
        except httpx.HTTPError:
            return False

    # -- stopping -------------------------------------------------------------------------

    def stop(self, grace_s: float | None = None) -> None:
        """Drain the request path (SIGTERM, then SIGKILL after its drain grace plus a margin),
        then the scheduler and the kvstore. ``force_stop`` (a second Ctrl-C) cuts the waits."""
        for child in self.children.values():
            child.restart_at = None  # nothing restarts from here on
        front = [c for c in self.children.values() if c.spec.service in REQUEST_PATH]
        back = [c for c in self.children.values() if c.spec.service not in REQUEST_PATH]
        self._stop_group(front, self.plan.drain_grace_s + KILL_MARGIN_S if grace_s is None else grace_s)
        self._stop_group(back, BACKEND_GRACE_S if grace_s is None else grace_s)
        for key in (self.run_dir / TLS_DIR).glob("*-key.pem"):  # the run is over: its private keys go with it
            key.unlink(missing_ok=True)

    def _stop_group(self, children: list[_Child], grace_s: float) -> None:
        first = [c.proc for c in children if c.proc is not None and c.spec.service not in DRAINS_AFTER_PREFILL]
        later = [c.proc for c in children if c.proc is not None and c.spec.service in DRAINS_AFTER_PREFILL]
        prefills = [c.proc for c in children if c.proc is not None and c.spec.service == "prefill"]
        deadline = time.monotonic() + grace_s
        self._terminate(first)
        self._wait_until_exited(prefills, deadline)
        self._terminate(later)
        self._wait_until_exited(first + later, deadline)
        for proc in first + later:
            if proc.poll() is None:
                log.warning("pid %d did not stop within %.0f s; killing it", proc.pid, grace_s)
                proc.kill()
            proc.wait()

    @staticmethod
    def _terminate(procs: list[subprocess.Popen]) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def _wait_until_exited(self, procs: list[subprocess.Popen], deadline: float) -> None:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline and not self.force_stop:
            time.sleep(0.05)
