"""The process shell shared by prefill, decode and aggregated instances.

Loads the engine, starts the gRPC service, registers with the scheduler and heartbeats its load.
The role-specific part (servicer, batcher) comes in through ``attach`` as an ``EngineRole``.

Lifecycle: a scheduler that refuses the registration (FAILED_PRECONDITION: the instance
disagrees with its model's others on block size, KV format or dtype) ends the process with a
logged error and a non-zero exit code. SIGTERM drains: ``/health`` answers 503 at once, the
instance leaves placement (Deregister), new work is refused, work in flight runs to completion
within ``drain_grace_s``; the role ends whatever is left (decode: UNAVAILABLE "decode draining",
which the gateway migrates), and only then does the gRPC server stop. A second signal cuts the
drain short.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from crescent.protos import common_pb2, scheduler_pb2
from crescent.services.common.grpc_service import GrpcService
from crescent.services.common.metrics import engine_metrics
from crescent.services.common.scheduler_agent import SchedulerAgent
from crescent.services.common.settings import ListenSettings
from crescent.services.common.tls import PeerTls, TlsSettings
from crescent.services.engine.engine import Engine
from crescent.services.engine.kv_cache import PageEventKind
from crescent.services.instance.runtime import EngineWorker, FatalServiceError, ShutdownSignals, build_engine
from crescent.services.engine.settings import EngineSettings
from crescent.services.instance.wire import kv_dtype

log = logging.getLogger(__name__)

ROLES = {"prefill": scheduler_pb2.INSTANCE_ROLE_PREFILL, "decode": scheduler_pb2.INSTANCE_ROLE_DECODE,
         "aggregated": scheduler_pb2.INSTANCE_ROLE_AGGREGATED}
PREFILLING = ("prefill", "aggregated")  # roles whose cache keeps prompts' blocks (published to the scheduler)
DRAIN_POLL_S = 0.05
STOP_GRACE_S = 2.0  # after the drain: time for the calls just ended to send their status


_EVENT_KINDS = {PageEventKind.STORED: common_pb2.BLOCK_EVENT_STORED, PageEventKind.REMOVED: common_pb2.BLOCK_EVENT_REMOVED}


def _event(engine: Engine, kind: int, key: bytes, parent: bytes | None) -> common_pb2.BlockEvent:
    return common_pb2.BlockEvent(kind=kind, key=key, parent_key=parent or b"", tier=common_pb2.KV_TIER_ENGINE,
                                 num_tokens=engine.block_size)


def block_events(engine: Engine) -> list[common_pb2.BlockEvent]:
    """Blocks stored in or evicted from the engine's cache since the last call."""
    return [_event(engine, _EVENT_KINDS[e.kind], e.key, e.parent_key) for e in engine.cache.pages.drain_events()]


def block_snapshot(engine: Engine) -> list[common_pb2.BlockEvent]:
    """Every block the engine's cache holds, for a full resync of the scheduler's index."""
    return [_event(engine, common_pb2.BLOCK_EVENT_STORED, key, parent) for key, parent in engine.cache.pages.snapshot()]


def kv_format(engine: Engine) -> str:
    """The layout of one KV block as instances of a model must agree on it, e.g. ``paged-v1:30x2x64x3x64``."""
    return "paged-v1:" + "x".join(str(d) for d in engine.cache.block_shape)


class ServingBackend(Protocol):
    """What the shell needs of whatever computes (the native engine, vLLM): the facts it registers
    with, and the blocks its own cache holds for the scheduler's prefix index."""

    model_id: str
    block_size: int
    kv_capacity_tokens: int
    kv_format: str
    kv_dtype: str
    context_window: int  # prompt + completion tokens it serves (the model's window)

    def unpromised_tokens(self) -> int:
        """KV tokens nobody was promised (the load report's default ``free_kv_tokens``)."""

    def block_events(self) -> list[common_pb2.BlockEvent]:
        """Blocks stored in or evicted from the engine's cache since the last call."""

    def block_snapshot(self) -> list[common_pb2.BlockEvent]:
        """Every block the engine's cache holds (a full resync of the scheduler's index)."""

    def details(self) -> dict[str, object]:
        """What ``/health`` shows of it."""


class NativeBackend:
    """Crescent's own engine as the shell sees it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model_id = engine.model_id
        self.block_size = engine.block_size
        self.kv_capacity_tokens = engine.cache.capacity_tokens
        self.kv_format = kv_format(engine)
        self.kv_dtype = kv_dtype(engine.cache)
        self.context_window = engine.config.max_position_embeddings  # hf_config.context_window of its config

    def unpromised_tokens(self) -> int:
        return self.engine.cache.pages.unpromised_pages * self.engine.block_size

    def block_events(self) -> list[common_pb2.BlockEvent]:
        return block_events(self.engine)

    def block_snapshot(self) -> list[common_pb2.BlockEvent]:
        return block_snapshot(self.engine)

    def details(self) -> dict[str, object]:
        return {"backend": "native", "model": self.model_id, "cached_blocks": self.engine.cache.pages.cached_blocks}


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """A role's load for the next heartbeat."""

    queued_requests: int = 0
    queued_tokens: int = 0
    running_requests: int = 0
    active_request_ids: Sequence[str] = ()    # every request held now
    finished_request_ids: Sequence[str] = ()  # requests that left since the last report
    free_kv_tokens: int | None = None         # None: the cache's pages nobody was promised
    # An aggregated instance's prompts (the fields above are then its decoding sequences').
    prefill_queued_requests: int = 0
    prefill_queued_tokens: int = 0
    prefill_running_requests: int = 0


class EngineRole(Protocol):
    """What prefill or decode adds to the shell: its load, and its part of a drain."""

    def load(self) -> EngineLoad:
        """The load now; hands over (and forgets) the ids that left since the last call."""

    def stop_accepting(self) -> None:
        """Refuse new requests with UNAVAILABLE "draining"."""

    def busy(self) -> bool:
        """Whether any request is still held (running, waiting or streaming out)."""

    async def end_remaining(self) -> None:
        """The grace ran out: end what is left so its callers can move it elsewhere."""

    async def close(self) -> None:
        """Stop background work (after the gRPC server stopped taking calls)."""


class EngineInstance:
    """One prefill or decode process: engine + worker + gRPC service + scheduler agent."""

    def __init__(self, role: str, listen: ListenSettings, engine_settings: EngineSettings, scheduler_address: str,
                 instance_id: str, advertise_address: str, tls: TlsSettings = TlsSettings(),
                 load_backend: Callable[[], Awaitable[ServingBackend]] | None = None) -> None:
        """``load_backend``: starts another engine backend (vLLM); None: the native engine."""
        self.role_name = role
        self.tls_settings = tls
        self.tls: PeerTls | None = None  # this process's key pair, once the gRPC service has read it
        self.listen = listen
        self.engine_settings = engine_settings
        self.scheduler_address = scheduler_address
        self._instance_id = instance_id
        self._advertise = advertise_address
        self.engine: Engine | None = None  # the native engine, when that is the backend
        self.backend: ServingBackend | None = None
        self._load_backend = load_backend
        self.worker = EngineWorker(role)
        self.agent: SchedulerAgent | None = None
        self.role: EngineRole | None = None
        self.draining = False
        self.address = ""  # host:port the scheduler knows it by, once serving
        self.group_size = 1  # processes computing the instance (engine.parallel), once loaded

    def nudge(self) -> None:
        """Report load now (a request arrived or left), so the scheduler's view stays fresh."""
        if self.agent is not None:
            self.agent.nudge()

    async def run(self, attach: Callable[[grpc.aio.Server], Awaitable[EngineRole]], signals: ShutdownSignals) -> None:
        """Load the engine, serve until a shutdown signal, drain, stop. ``attach`` adds the servicers."""
        if self._load_backend is None:
            self.engine = await self.worker.run(build_engine, self.engine_settings)
            self.backend = NativeBackend(self.engine)
        else:
            self.backend = await self._load_backend()
        backend = self.backend
        self.group_size = self.engine_settings.parallel.resolve().size
        engine_metrics(self.role_name).group_size.labels(self.role_name).set(self.group_size)

        async def setup(server: grpc.aio.Server) -> None:
            self.role = await attach(server)

        async def cleanup() -> None:
            if self.agent is not None:
                await self.agent.stop()
            if self.role is not None:
                await self.role.close()

        async def register(service: GrpcService) -> None:
            info = self._info(service.port)
            self.address = info.address
            self.agent = SchedulerAgent(
                self.scheduler_address, info, self._load_message,
                events=backend.block_events if self.role_name in PREFILLING else None,
                snapshot=backend.block_snapshot if self.role_name in PREFILLING else None,
                tls=self.tls,
            )
            self.agent.start()

        service = GrpcService(
            self.role_name, self.listen, setup, cleanup,
            ready=lambda: self.agent is not None and self.agent.registered.is_set(),
            details=self._details, on_started=register, tls=self.tls_settings,
        )
        self.tls = service.tls  # before start: ``attach`` opens its clients with it
        await service.start()
        try:
            refused = await self._until_stop_or_refused(signals)
            if refused is not None:
                log.error("the scheduler refused this %s instance: %s", self.role_name, refused)
                raise FatalServiceError(refused)
            service.draining = True
            await self._drain(signals.hurry)
        finally:
            await service.stop(STOP_GRACE_S)

    async def _until_stop_or_refused(self, signals: ShutdownSignals) -> str | None:
        """Wait for a shutdown signal; the scheduler's reason if it refuses us for good first."""
        failed = getattr(self.agent, "failed", None)  # the agent sets it on FAILED_PRECONDITION
        waits = [asyncio.create_task(signals.requested.wait())]
        if isinstance(failed, asyncio.Event):
            waits.append(asyncio.create_task(failed.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        if isinstance(failed, asyncio.Event) and failed.is_set():
            return str(getattr(self.agent, "fatal_error", None) or "registration refused")
        return None

    async def _drain(self, hurry: asyncio.Event) -> None:
        assert self.role is not None
        grace = self.engine_settings.drain_grace_s
        log.info("draining: taking no new requests, giving those in flight up to %g s", grace)
        self.draining = True
        self.role.stop_accepting()
        if self.agent is not None:
            await self.agent.deregister()
        deadline = time.monotonic() + grace
        while self.role.busy() and not hurry.is_set() and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(hurry.wait(), DRAIN_POLL_S)
            except TimeoutError:
                pass
        if self.role.busy():
            log.warning("drain over (%s) with requests still held; ending them",
                        "cut short" if hurry.is_set() else f"{grace:g} s grace")
            await self.role.end_remaining()
        log.info("drained")

    def _info(self, port: int) -> scheduler_pb2.InstanceInfo:
        backend = self.backend
        assert backend is not None
        address = self._advertise or f"{self.listen.host}:{port}"
        return scheduler_pb2.InstanceInfo(
            instance_id=self._instance_id or f"{self.role_name}-{socket.gethostname()}-{port}",
            role=ROLES[self.role_name], address=address, model_id=backend.model_id,
            block_size=backend.block_size, kv_capacity_tokens=backend.kv_capacity_tokens,
            max_batch_size=self.engine_settings.max_batch_size, kv_format=backend.kv_format,
            kv_dtype=backend.kv_dtype, context_window=backend.context_window,
        )

    def _load_message(self) -> scheduler_pb2.InstanceLoad:
        assert self.backend is not None and self.agent is not None
        load = self.role.load() if self.role is not None else EngineLoad()
        free = load.free_kv_tokens
        if free is None:
            free = self.backend.unpromised_tokens()
        return scheduler_pb2.InstanceLoad(
            instance_id=self.agent.instance_id, queued_requests=load.queued_requests,
            queued_tokens=load.queued_tokens, running_requests=load.running_requests, free_kv_tokens=free,
            active_request_ids=list(load.active_request_ids), finished_request_ids=list(load.finished_request_ids),
            draining=self.draining, prefill_queued_requests=load.prefill_queued_requests,
            prefill_queued_tokens=load.prefill_queued_tokens, prefill_running_requests=load.prefill_running_requests,
        )

    def _details(self) -> dict[str, object]:
        if self.backend is None:
            return {"role": self.role_name}
        return {"role": self.role_name, **self.backend.details(), "draining": self.draining,
                "group_size": self.group_size}
