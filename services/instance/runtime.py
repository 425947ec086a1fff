"""What a serving process wraps around an ``Engine``: loading it, and one worker thread.

Engine calls block for milliseconds to seconds, so they run on one dedicated thread (the engine
is not thread-safe, and torch already uses the cores); the asyncio loop stays free for gRPC.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
import queue
import signal
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from crescent.services.engine.device import (check_block_size_fits, check_cache_dtype_fits, dtype_name,
                                            resolve_cache_dtype, resolve_device, resolve_dtype)
from crescent.services.engine.engine import Engine
from crescent.services.engine.llama import LlamaModel
from crescent.services.engine.loader import load_model
from crescent.services.engine.parallel.settings import GroupSettingsError
from crescent.services.model.model_source import resolve_model
from crescent.services.engine.settings import EngineSettings

log = logging.getLogger(__name__)

T = TypeVar("T")


def build_engine(settings: EngineSettings, *, progress: bool = True) -> Engine:
    torch.set_num_threads(settings.threads)
    device = resolve_device(settings.device)  # before the model loads: a missing GPU fails at once
    source = resolve_model(settings.model)
    group = settings.parallel.resolve()
    group.check_leader()  # before the model loads: a worker's settings on a server fail at once
    if group.size > 1 and (device.type != "cpu" or settings.dtype not in ("auto", "float32")):
        raise GroupSettingsError(f"engine.device {settings.device!r}, engine.dtype {settings.dtype!r} with "
                                 f"engine.parallel.group_size {group.size}: tensor-parallel groups run on the CPU "
                                 "(gloo) in float32 only; use device: cpu and dtype: auto")
    check_cache_dtype_fits(settings.kv_cache_dtype, settings.model, source.kind)
    check_block_size_fits(settings.device, settings.block_size, source.kind)
    if group.size > 1 and source.kind == "kimi_k3":
        raise GroupSettingsError(f"engine.parallel.group_size {group.size}: tensor parallelism covers Llama-family "
                                 f"models; {settings.model!r} is a kimi_k3 model (expert parallelism is not built)")
    cache_dtype = None  # kimi_k3: its cache takes the dtype from the model (load_k3_model's cache_dtype)
    if source.kind == "kimi_k3":  # the hybrid family loads through its own package
        from crescent.services.engine.kimi_k3.loading import load_k3_model
        from crescent.services.engine.kimi_k3.snapshots import SnapshotPolicy

        policy = SnapshotPolicy(every_blocks=settings.state_snapshot_every_blocks, slots=settings.state_snapshots)
        dtype = None if settings.kv_cache_dtype == "auto" else settings.kv_cache_dtype
        # on CUDA the Triton kernels (docs/k3.md, "On a GPU"); not yet run on a GPU: scripts/gpu_check.sh
        model = load_k3_model(source, device=device, dtype=settings.dtype, mxfp4_experts=settings.mxfp4_experts,
                              snapshots=policy, cache_dtype=dtype)
        model_id = source.model_id
    else:
        loaded = load_model(source, progress=progress)
        model_id = loaded.model_id
        if group.size > 1:  # this process leads a group; its workers run parallel/worker.py
            from crescent.services.engine.parallel.leader import leader_model

            model = leader_model(loaded.config, loaded.weights, group)
        else:
            dtype = resolve_dtype(settings.dtype, device, loaded.torch_dtype)
            model = LlamaModel(loaded.config, loaded.weights, device=device, dtype=dtype)
            cache_dtype = resolve_cache_dtype(settings.kv_cache_dtype, dtype)
        del loaded
    engine = Engine(
        model,
        model_id=model_id,
        kv_capacity_tokens=settings.kv_capacity_tokens,
        block_size=settings.block_size,
        prefill_chunk_tokens=settings.prefill_chunk_tokens,
        min_cached_prompt_tokens=settings.min_cached_prompt_tokens,
        kv_cache_dtype=cache_dtype,
    )
    log.info(
        "engine ready: model %s, %d KV pages of %d tokens (%.2f GB)",
        model_id, engine.cache.pages.num_pages, settings.block_size, engine.cache.nbytes() / 1e9,
    )
    if isinstance(model, LlamaModel):
        log.info("engine on %s: weights and activations %s, KV cache %s, attention path %s", model.device,
                 dtype_name(model.dtype), dtype_name(engine.cache.pool.dtype), model.attention_path(engine.cache).name)
    footprint = getattr(model, "footprint", None)  # hybrid models: latents per token, state per block
    if footprint is not None:
        from crescent.services.engine.kimi_k3.metrics import publish_expert_load

        publish_expert_load(model)
        fp = footprint()
        log.info("cache footprint: %d B of latents per token, %d B of recurrent state per running sequence and per "
                 "snapshot (%d snapshots at most)", fp.kv_bytes_per_token, fp.snapshot_bytes_per_block,
                 model.snapshot_policy.slots)
    return engine


class EngineWorker:
    """Runs engine calls one at a time, in order, on the process's main thread.

    The main thread matters: OpenMP (behind torch and oneDNN) keeps its thread team warm for the
    main thread, while parallel regions started from another thread pay a start-up cost each
    time — measured here as decode steps 40-50% slower. So the asyncio side runs in a thread of
    its own and hands engine calls to the main thread (``run_engine_process``).

    A call, once submitted, always runs to completion: cancelling the coroutine that awaits it
    (a client went away) only drops the result. A call that hands out resources therefore takes
    ``orphan``, which gets the result when nobody is left to receive it (e.g. release a sequence's
    pages). ``pending`` counts calls submitted and not finished.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[[], object]] | None] = queue.SimpleQueue()
        self.pending = 0

    async def run(
        self, fn: Callable[..., T], *args: object, orphan: Callable[[T], object] | None = None, **kwargs: object
    ) -> T:
        job = self._submit(lambda: fn(*args, **kwargs))
        try:
            return await asyncio.shield(asyncio.wrap_future(job))
        except asyncio.CancelledError:
            if orphan is not None:
                job.add_done_callback(lambda done: done.exception() is None and self.submit(orphan, done.result()))
            raise

    def submit(self, fn: Callable[..., object], *args: object, then: Callable[[], object] | None = None) -> None:
        """Queue a call nobody waits for (e.g. releasing pages); failures are logged. ``then``
        runs on the calling event loop once the call is done."""
        loop = asyncio.get_running_loop() if then is not None else None
        job = self._submit(lambda: fn(*args))

        def done(job: Future) -> None:
            if job.exception() is not None:
                log.error("engine call %s failed", fn, exc_info=job.exception())
            if loop is not None and then is not None and not loop.is_closed():
                loop.call_soon_threadsafe(then)

        job.add_done_callback(done)

    def _submit(self, call: Callable[[], T]) -> Future[T]:
        job: Future[T] = Future()
        self.pending += 1
        self._jobs.put((job, call))
        return job

    def serve_forever(self) -> None:
        """Run submitted calls on the calling thread until ``shutdown``."""
        while (item := self._jobs.get()) is not None:
            job, call = item
            if job.set_running_or_notify_cancel():
                try:
                    job.set_result(call())
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                    job.set_exception(exc)
            self.pending -= 1

    def shutdown(self) -> None:
        """Let ``serve_forever`` return once the calls already queued have run."""
        self._jobs.put(None)


class FatalServiceError(RuntimeError):
    """The process cannot serve (e.g. the scheduler refused its registration). The reason has
    been logged; ``run_engine_process`` exits with a non-zero code."""


@dataclass(frozen=True, slots=True)
class ShutdownSignals:
    """What SIGTERM/SIGINT ask of a serving process."""

    requested: asyncio.Event  # the first signal: drain, then exit
    hurry: asyncio.Event      # a second signal: cut the drain short


def _signalled(name: str, seen: int, event: asyncio.Event) -> None:
    """On the loop (logging in a signal handler could deadlock): note the signal, set its event."""
    if seen > 1:
        log.warning("%s again: cutting the drain short", name)
    else:
        log.info("%s: draining, then exiting", name)
    event.set()


def run_engine_process(worker: EngineWorker, serve: Callable[[ShutdownSignals], Awaitable[None]]) -> None:
    """Run ``serve(signals)`` on an asyncio loop in a second thread while this (main) thread runs
    engine calls; the first SIGINT/SIGTERM sets ``signals.requested``, a second one
    ``signals.hurry``. Re-raises what ``serve`` raised; exits with code 1 on ``FatalServiceError``."""
    started = threading.Event()
    state: dict[str, object] = {}

    async def loop_main() -> None:
        signals = ShutdownSignals(asyncio.Event(), asyncio.Event())
        state["loop"], state["signals"] = asyncio.get_running_loop(), signals
        started.set()
        try:
            await serve(signals)
        finally:
            worker.shutdown()

    def loop_thread() -> None:
        try:
            asyncio.run(loop_main())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            state["error"] = exc
        finally:
            started.set()
            worker.shutdown()

    def on_signal(signum: int, _frame: object) -> None:
        loop, signals = state.get("loop"), state.get("signals")
        if not isinstance(loop, asyncio.AbstractEventLoop) or not isinstance(signals, ShutdownSignals):
            return
        state["signalled"] = seen = int(state.get("signalled", 0)) + 1
        event = signals.hurry if seen > 1 else signals.requested
        loop.call_soon_threadsafe(_signalled, signal.Signals(signum).name, seen, event)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    thread = threading.Thread(target=loop_thread, name=f"{worker.name}-asyncio")
    thread.start()
    started.wait()
    worker.serve_forever()
    thread.join()
    error = state.get("error")
    if isinstance(error, FatalServiceError):
        raise SystemExit(1)
    if error is not None:
        raise error  # type: ignore[misc]
