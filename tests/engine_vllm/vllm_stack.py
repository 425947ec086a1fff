"""Real processes on loopback for the vLLM backend's tests: scheduler, kvstore and gateway from
this interpreter, vLLM-backed engine instances and a standalone vLLM server from the vLLM
venv (``make install-vllm``). Started by hand rather than through ``crescent up`` so a test can
stop, kill or add one engine instance while the rest keeps running.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import openai
import yaml
from tokenizers import Tokenizer

from crescent.protos import scheduler_pb2, scheduler_pb2_grpc
from crescent.services.engine_vllm.interpreter import VllmNotInstalledError, vllm_python
from crescent.services.engine_vllm.model_dir import vllm_model
from crescent.services.engine_vllm.reaper import descendants, process_stat
from crescent.services.model.model_source import DEFAULT_MODEL
from tests.ports import free_port

VLLM_START_S = 900  # a vLLM start is mostly imports now (eager): 1-2 min here, but 13 min at load 50-150 with memory short
# A SIGTERM'd instance finishes its streams within this: 160 tokens took 20+ s on 2 cores shared
# with other test runs (2026-12-05, load ~20), and a stream cut at the grace is not a drain.
DRAIN_GRACE_S = 90
# The gateway loads the model's tokenizer before it answers: 120 s was not enough at load ~20.
CONTROL_PLANE_START_S = 300
# One request's wait: the peer's 160-token greedy reference timed out at 300 s while the machine
# thrashed (load ~100, no memory free, 2026-12-05); the test's own timeout still bounds it.
REQUEST_TIMEOUT_S = 600
# Every vLLM here (the peer and the instances, ``engine.vllm.enforce_eager``) runs eagerly: with
# an explicit KV size vLLM's CPU build then neither compiles (inductor) nor warms up. That was
# most of a start: vLLM's "init engine" took 269-377 s compiled and 1-3 s eager on this shared
# machine (docs/test-durations.md). The peer and the instances run the same kernels, so greedy
# outputs still compare token for token; what the tests check (connector, handoffs, migration,
# drain) runs the same either way. Production keeps vLLM's default (compiled).
VLLM_EAGER = True


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

    def stop(self, timeout_s: float = DRAIN_GRACE_S + 30) -> int:
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


class PeerVllm:
    """Standalone vLLM (its own OpenAI server) on the same weights: what Crescent-over-vLLM must
    equal. One per test session (the ``vllm_peer`` fixture of tests/engine_vllm/conftest.py), so
    prefix caching is off: every reply is a cold prefill whatever another module asked before."""

    def __init__(self, run_dir: Path, python: str, model_dir: Path, served_name: str, block_size: int) -> None:
        port = free_port()
        log = run_dir / "peer-vllm.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
               "VLLM_CACHE_ROOT": str(run_dir / "peer-cache"), "TORCHINDUCTOR_CACHE_DIR": str(run_dir / "peer-inductor")}
        proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
             served_name, "--dtype", "float32", "--block-size", str(block_size), "--max-model-len", "8192",
             "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details", "--no-enable-prefix-caching",
             *(["--enforce-eager"] if VLLM_EAGER else [])],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.url = f"http://127.0.0.1:{port}"
        self.service = Service("peer-vllm", proc, log, health=f"{self.url}/health")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def stop(self) -> None:
        self.service.stop(timeout_s=30)


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


ADMIN_KEY = "admin-" + uuid.uuid4().hex
BLOCK = 64
MODEL = DEFAULT_MODEL


@dataclass(frozen=True)
class StackModel:
    """What a stack serves: the model setting (preset, GGUF or Hugging Face directory) of the
    gateway and every engine, Crescent's block size, and the engines' other settings."""

    spec: str
    block_size: int
    vllm: dict = field(default_factory=dict)      # engine.vllm beyond the stack's defaults
    engine: dict = field(default_factory=dict)    # other engine settings (min_cached_prompt_tokens, ...)


DEFAULT_STACK_MODEL = StackModel(MODEL, BLOCK, {"dtype": "float32"})


class VllmStack:
    """Scheduler, kvstore and gateway (auth on, tenants acme and globex) and vLLM-backed engine
    instances of the roles asked for; beside them the session's standalone vLLM (``peer``), which
    this stack waits for but never stops."""

    def __init__(self, run_dir: Path, peer: PeerVllm | None, model: StackModel = DEFAULT_STACK_MODEL) -> None:
        self.run_dir = run_dir
        self.python = vllm_interpreter()
        self.services: dict[str, Service] = {}
        self.gateway_url = ""
        self.peer_url = peer.url if peer is not None else ""
        self._peer = peer
        self.model = model
        self.keys: dict[str, str] = {}

    def start(self, engines: dict[str, str]) -> None:
        """``engines``: instance id -> role (aggregated, prefill or decode)."""
        run = self.run_dir
        scheduler = start_service(run, "scheduler", "scheduler", {"listen": listen()})
        kv = {"listen": listen(), "node_id": "kvstore-0", "scheduler_address": scheduler.grpc,
              "tiers": {"host": {"capacity_bytes": 2_000_000_000}}}
        kvstore = start_service(run, "kvstore", "kvstore", kv)
        port = listen()["port"]
        gateway = start_service(run, "gateway", "gateway", {
            "listen": {"host": "127.0.0.1", "port": port}, "scheduler_address": scheduler.grpc, "model": self.model.spec,
            "auth": {"enabled": True, "admin_key": ADMIN_KEY, "database_url": f"sqlite:///{run}/gateway.sqlite3"},
            "ledger": {"journal_dir": str(run / "ledger-journal")}})
        self.gateway_url = f"http://127.0.0.1:{port}"
        self.services.update(scheduler=scheduler, kvstore=kvstore, gateway=gateway)
        started = [self.start_engine(name, role) for name, role in engines.items()]
        wait_healthy([scheduler, kvstore, gateway], CONTROL_PLANE_START_S)
        peer = [self._peer.service] if self._peer is not None else []
        wait_healthy([*started, *peer], VLLM_START_S)  # the peer: once, for the first stack
        wait_healthy([gateway], 60)
        for tenant in ("acme", "globex"):
            reply = httpx.post(f"{self.gateway_url}/admin/keys", json={"tenant": tenant, "create_tenant": True},
                               headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
            assert reply.status_code == 201, reply.text
            self.keys[tenant] = reply.json()["key"]

    def start_engine(self, name: str, role: str) -> Service:
        config = {"listen": listen(), "instance_id": name, "scheduler_address": self.services["scheduler"].grpc,
                  "kvstore_address": self.services["kvstore"].grpc,
                  "engine": {"backend": "vllm", "model": self.model.spec, "block_size": self.model.block_size,
                             "threads": 1, "drain_grace_s": DRAIN_GRACE_S, **self.model.engine,
                             "vllm": {"cpu_kv_cache_gb": 1, "enforce_eager": VLLM_EAGER, **self.model.vllm}}}
        engine = start_service(self.run_dir, name, role, config, python=self.python)
        self.services[name] = engine
        return engine

    def add_engines(self, names: tuple[str, ...], role: str = "aggregated") -> None:
        """Start those of ``names`` not started yet, all at once, and wait until each is healthy."""
        started = [self.start_engine(name, role) for name in names if name not in self.services]
        wait_healthy(started, VLLM_START_S)

    def client(self, tenant: str = "acme") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway_url}/v1", api_key=self.keys[tenant], timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def peer(self) -> openai.OpenAI:
        assert self._peer is not None, "this stack was started without the standalone vLLM"
        return self._peer.client()

    def kvstore_hits(self) -> float:
        """Blocks the kvstore has served (decode's loads: prefill only asks which blocks exist)."""
        admin = self.services["kvstore"].health.removesuffix("/health")
        text = httpx.get(f"{admin}/metrics", timeout=5).text
        return sum(float(v) for v in re.findall(r'^crescent_kvstore_hits_total\{[^}]*\} (\S+)$', text, re.M))

    def instances(self) -> dict[str, scheduler_pb2.InstanceStatus]:
        with grpc.insecure_channel(self.services["scheduler"].grpc) as channel:
            reply = scheduler_pb2_grpc.SchedulerStub(channel).ListInstances(scheduler_pb2.ListInstancesRequest(),
                                                                           timeout=5)
        return {s.info.instance_id: s for s in reply.instances}

    def kill_9(self, name: str) -> dict[int, int]:
        """SIGKILL instance ``name``; the vLLM processes (engine core, workers) it had, by pid."""
        processes = descendants(self.services[name].proc.pid)
        assert processes, f"{name} runs vLLM's engine core and workers as processes of its own"
        os.kill(self.services[name].proc.pid, signal.SIGKILL)
        return processes

    def stop(self) -> None:
        for service in reversed(list(self.services.values())):
            service.stop(timeout_s=30)


def assert_reaped(processes: dict[int, int], timeout_s: float = 10) -> None:
    """None of ``processes`` (pid -> start time) outlives its killed instance by ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(process_stat(pid) is not None and process_stat(pid)[1] == start for pid, start in processes.items()):
        assert time.monotonic() < deadline, "vLLM's processes outlived the killed instance"
        time.sleep(0.2)


def prompt_ids(words: int, nonce: str) -> list[int]:
    """A token-id prompt of about ``words`` tokens (ids of plain words, so both servers take it alike)."""
    tokenizer = Tokenizer.from_file(str(vllm_model(MODEL).directory / "tokenizer.json"))
    text = f"Note {nonce}. " + " ".join(f"crate {i} goes to dock {i * 7 % 11}." for i in range(words // 8))
    return tokenizer.encode(text, add_special_tokens=False).ids


def completion(client: openai.OpenAI, prompt: list[int], max_tokens: int = 24, **kwargs):  # noqa: ANN201
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens, **kwargs)


def cached(reply) -> int:  # noqa: ANN001
    details = reply.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


class ConcurrentStreams:
    """Streamed completions (``ignore_eos``, usage included) read on threads, for the tests that
    kill or drain an instance while they run."""

    def __init__(self, client: Callable[[], openai.OpenAI], prompts: list[list[int]], max_tokens: int) -> None:
        self.client = client
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.results: list[tuple[str, int] | BaseException] = [("", 0)] * len(prompts)
        self._started = [threading.Event() for _ in prompts]
        self._threads = [threading.Thread(target=self._read, args=(i,)) for i in range(len(prompts))]

    def _read(self, i: int) -> None:
        try:
            text, chunks, usage = "", 0, None
            for chunk in completion(self.client(), self.prompts[i], max_tokens=self.max_tokens, stream=True,
                                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                text += chunk.choices[0].text if chunk.choices else ""
                usage = chunk.usage or usage
                chunks += 1
                if chunks >= 4:
                    self._started[i].set()
            self.results[i] = (text, usage.completion_tokens if usage else -1)
        except BaseException as exc:  # noqa: BLE001 - reported by check()
            self.results[i] = exc
            self._started[i].set()

    def start(self, timeout_s: float = 180) -> None:
        """Start every stream; return once each has streamed a few tokens."""
        for thread in self._threads:
            thread.start()
        for event in self._started:
            assert event.wait(timeout_s)

    def check(self, reference: list[str], timeout_s: float = 300) -> None:
        """Every stream ended whole: ``max_tokens`` tokens, none lost or repeated, its greedy text ``reference``."""
        for thread in self._threads:
            thread.join(timeout_s)
        for i, result in enumerate(self.results):
            assert not isinstance(result, BaseException), f"stream {i} failed: {result!r}"
            text, tokens = result
            assert tokens == self.max_tokens, f"stream {i}: no token lost or repeated"
            assert text == reference[i], f"stream {i}: greedy text continues where it stopped"


def assert_greedy_equals_the_peer(stack: VllmStack, prompt: list[int]) -> str:
    """Crescent's greedy completion of ``prompt`` is the standalone vLLM's, token for token; its text."""
    ours = completion(stack.client(), prompt)
    theirs = completion(stack.peer(), prompt)
    assert ours.choices[0].text == theirs.choices[0].text, f"{len(prompt)}-token prompt"
    assert ours.usage.prompt_tokens == len(prompt)
    assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason
    return theirs.choices[0].text
