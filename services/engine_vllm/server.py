"""``crescent serve aggregated|prefill|decode`` with ``engine.backend: vllm``: vLLM's engine in
this process, behind the same process shell (registration, heartbeats, drain, /health, /metrics)
and the same gRPC services as a native instance of that role; gateway, scheduler and kvstore
cannot tell them apart (prefill and decode: handoff.py). Crescent's KV connector runs inside vLLM (its scheduler and workers) and sends what vLLM's
cache holds back here over a Unix socket, for the scheduler's prefix index.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import grpc

from crescent.services.aggregated.config import AggregatedSettings
from crescent.services.common.settings import SettingsError
from crescent.services.decode.config import DecodeSettings
from crescent.services.decode.servicer import add_decode_to_server
from crescent.services.instance.shell import EngineInstance, EngineLoad
from crescent.services.instance.runtime import EngineWorker, ShutdownSignals, run_engine_process
from crescent.services.engine_vllm.block_events import EngineBlockSet
from crescent.services.engine_vllm.connector_options import ConnectorOptions
from crescent.services.engine_vllm.engine import BackendFacts, prepare_environment, start_engine
from crescent.services.engine_vllm.model_dir import vllm_model
from crescent.services.engine_vllm.reaper import watch_descendants
from crescent.services.engine_vllm.start_guard import StartGuard, StartInterrupted
from crescent.services.engine_vllm.handoff import VllmDecodeServicer, VllmPrefillServicer
from crescent.services.engine_vllm.servicer import VllmServicer
from crescent.services.kvstore.client import KvStoreClient
from crescent.services.prefill.config import PrefillSettings
from crescent.services.prefill.servicer import add_prefill_to_server

log = logging.getLogger(__name__)


class VllmBackend:
    """The shell's view of vLLM (``ServingBackend``): its facts, and the blocks its cache holds
    as the connector reports them."""

    def __init__(self, llm, facts: BackendFacts, blocks: EngineBlockSet) -> None:  # noqa: ANN001 - AsyncLLM
        self.llm = llm
        self.facts = facts
        self.blocks = blocks
        self.model_id = facts.model_id
        self.block_size = facts.block_size
        self.kv_capacity_tokens = facts.kv_capacity_tokens
        self.kv_format = facts.kv_format
        self.kv_dtype = facts.kv_dtype
        self.context_window = facts.max_model_len
        self.reserved_tokens = lambda: 0  # the servicer's promises, once it exists

    def unpromised_tokens(self) -> int:
        return max(self.kv_capacity_tokens - self.reserved_tokens(), 0)

    def block_events(self) -> list:
        return self.blocks.drain_events()

    def block_snapshot(self) -> list:
        return self.blocks.snapshot()

    def details(self) -> dict[str, object]:
        return {"backend": "vllm", "model": self.model_id, "cached_blocks": len(self.blocks.held),
                "kv_capacity_tokens": self.kv_capacity_tokens}


class VllmRole:
    """Load reports and drains (``EngineRole``) over the servicer's requests."""

    def __init__(self, servicer: VllmServicer) -> None:
        self.servicer = servicer

    def load(self) -> EngineLoad:
        held = list(self.servicer.requests.values())
        waiting = [h for h in held if not h.handed_off]
        running = [h for h in held if h.handed_off]
        left, self.servicer.left = self.servicer.left, []
        return EngineLoad(
            running_requests=len(running), active_request_ids=sorted(h.request_id for h in held),
            finished_request_ids=left, prefill_queued_requests=len(waiting),
            prefill_queued_tokens=sum(h.prompt_tokens for h in waiting),
        )

    def stop_accepting(self) -> None:
        self.servicer.accepting = False

    def busy(self) -> bool:
        return bool(self.servicer.requests)

    async def end_remaining(self) -> None:
        self.servicer.end_remaining()

    async def close(self) -> None:
        await self.servicer.close()


Role = Literal["aggregated", "prefill", "decode"]
InstanceSettings = AggregatedSettings | PrefillSettings | DecodeSettings


async def start_backend(settings: InstanceSettings, role: Role, run_dir: Path, worker: EngineWorker) -> VllmBackend:
    """vLLM started with Crescent's connector, whose block events this process listens for. A
    SIGTERM/SIGINT during the start stops it there (``StartInterrupted``; start_guard.py)."""
    guard = StartGuard()
    await worker.run(guard.install)  # the worker runs calls on the main thread, where handlers live
    try:
        return await _start_backend(settings, role, run_dir, guard)
    finally:
        await worker.run(guard.remove)


async def _start_backend(settings: InstanceSettings, role: Role, run_dir: Path, guard: StartGuard) -> VllmBackend:
    model = vllm_model(settings.engine.model)  # the first start of a GGUF exports it: minutes
    guard.check()
    blocks = EngineBlockSet(settings.engine.block_size)
    socket_path = run_dir / "block-events.sock"
    await blocks.listen(str(socket_path))
    connector = None
    if settings.engine.vllm.kv_connector:
        tls = settings.tls
        connector = ConnectorOptions(
            model_id=model.model_id, block_size=settings.engine.block_size,
            kvstore_address=settings.kvstore_address, kvstore_shared_memory=settings.kvstore_shared_memory,
            lease_ms=settings.kvstore_lease_ms, events_socket=str(socket_path),
            tls_ca=tls.ca, tls_cert=tls.cert, tls_key=tls.key, tls_server_name=tls.server_name,
            saves_wait=role == "prefill")
    log.info("starting vLLM on %s (%s) as %s; this takes minutes on a CPU", model.directory, model.model_id, role)
    try:
        llm, facts = start_engine(settings.engine, model, connector)
    except Exception:
        await blocks.close()
        guard.check()  # vLLM's start failed because the signal stopped its processes: not an error
        raise
    if guard.signalled.is_set():  # the start won the race with the signal
        llm.shutdown()
        await blocks.close()
        guard.check()
    log.info("vLLM ready: %s, %d KV tokens, blocks %s (%s)", facts.model_id, facts.kv_capacity_tokens,
             facts.kv_format, facts.kv_dtype)
    return VllmBackend(llm, facts, blocks)


def check_role(settings: InstanceSettings, role: Role) -> None:
    """A prefill or decode instance on vLLM moves prompts through the kvstore (services/engine_vllm/handoff.py)."""
    if role == "aggregated":
        return
    if not settings.engine.vllm.kv_connector:
        raise SettingsError(f"a {role} instance on vLLM hands prompts over through Crescent's KV connector; "
                            "engine.vllm.kv_connector must stay true")
    if not settings.kvstore_address:
        raise SettingsError(f"a {role} instance on vLLM needs kvstore_address: its prompts' KV moves from "
                            "prefill to decode through the node's kvstore")


async def serve(settings: InstanceSettings, role: Role, instance: EngineInstance, signals: ShutdownSignals) -> None:
    async def attach(server: grpc.aio.Server) -> VllmRole:
        backend = instance.backend
        assert isinstance(backend, VllmBackend)
        common = dict(own_address=lambda: instance.address, unclaimed_timeout_s=getattr(settings, "unclaimed_timeout_s", 10.0),
                      min_cached_prompt_tokens=settings.engine.min_cached_prompt_tokens, on_change=instance.nudge)
        if role == "prefill":
            store = KvStoreClient(settings.kvstore_address, shared_memory=settings.kvstore_shared_memory, tls=instance.tls)
            servicer: VllmServicer = VllmPrefillServicer(backend.llm, backend.facts, store=store, tls=instance.tls, **common)
        elif role == "decode":
            servicer = VllmDecodeServicer(backend.llm, backend.facts, **common)
        else:
            servicer = VllmServicer(backend.llm, backend.facts, **common)
        backend.reserved_tokens = lambda: sum(h.reserve_tokens for h in servicer.requests.values())
        add_prefill_to_server(servicer, server)
        add_decode_to_server(servicer, server)
        return VllmRole(servicer)

    try:
        await instance.run(attach, signals)
    except StartInterrupted as stopped:
        log.info("%s; stopped before serving", stopped)
    finally:
        backend = instance.backend
        if isinstance(backend, VllmBackend):
            await backend.blocks.close()
            backend.llm.shutdown()


def main(settings: InstanceSettings, role: Role = "aggregated") -> None:
    check_role(settings, role)
    watch_descendants()  # before any thread: vLLM's processes must not outlive a killed instance
    prepare_environment(settings.engine, Path.home() / ".cache" / "crescent")
    run_dir = Path(tempfile.mkdtemp(prefix="crescent-vllm-"))
    instance = EngineInstance(role, settings.listen, settings.engine, settings.scheduler_address,
                              settings.instance_id, settings.advertise_address, settings.tls,
                              load_backend=lambda: start_backend(settings, role, run_dir, instance.worker))
    try:
        run_engine_process(instance.worker, lambda signals: serve(settings, role, instance, signals))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
