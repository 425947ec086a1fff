"""What a serving process wraps around an ``Engine``: loading it, and one worker thread.

Engine calls block for milliseconds to seconds, so they run on one dedicated thread (the engine
is not thread-safe, and torch already uses the cores); the asyncio loop stays free for gRPC.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from crescent.services.engine.engine import Engine
from crescent.services.engine.llama import LlamaModel
from crescent.services.engine.loader import load_model
from crescent.services.engine.model_source import resolve_model
from crescent.services.engine.settings import EngineSettings

log = logging.getLogger(__name__)

T = TypeVar("T")


def build_engine(settings: EngineSettings, *, progress: bool = True) -> Engine:
    torch.set_num_threads(settings.threads)
    source = resolve_model(settings.model)
    if source.kind == "kimi_k3":  # the hybrid family loads through its own package
        from crescent.services.engine.kimi_k3.loading import load_k3_model

        model, model_id = load_k3_model(source), source.model_id
    else:
        loaded = load_model(source, progress=progress)
        model, model_id = LlamaModel(loaded.config, loaded.weights), loaded.model_id
    engine = Engine(
        model,
        model_id=model_id,
        kv_capacity_tokens=settings.kv_capacity_tokens,
        page_size=settings.block_size,
        prefill_chunk_tokens=settings.prefill_chunk_tokens,
    )
    log.info(
        "engine ready: model %s, %d KV pages of %d tokens (%.2f GB)",
        model_id, engine.cache.pages.num_pages, settings.block_size, engine.cache.nbytes() / 1e9,
    )
    footprint = getattr(model, "footprint", None)  # hybrid models: latents per token, state per block
    if footprint is not None:
        from crescent.services.engine.kimi_k3.metrics import publish_expert_load

        publish_expert_load(model)
        fp = footprint()
        log.info("cache footprint: %d B of latents per token, %d B of recurrent state per sequence and per block",
                 fp.kv_bytes_per_token, fp.snapshot_bytes_per_block)
    return engine


class EngineWorker:
    """Runs engine calls one at a time, in order, on a dedicated thread.

    A call, once submitted, always runs to completion: cancelling the coroutine that awaits it
    (a client went away) only drops the result. A call that hands out resources therefore takes
    ``orphan``, which gets the result when nobody is left to receive it (e.g. release a sequence's
    pages). ``pending`` counts calls submitted and not finished.
    """

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
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

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Queue a call nobody waits for (e.g. releasing pages); failures are logged."""
        job = self._submit(lambda: fn(*args))
        job.add_done_callback(lambda done: done.exception() and log.error("engine call %s failed", fn, exc_info=done.exception()))

    def _submit(self, call: Callable[[], T]) -> Future[T]:
        self.pending += 1
        job = self._executor.submit(call)
        job.add_done_callback(self._finished)
        return job

    def _finished(self, _job: Future) -> None:
        self.pending -= 1  # runs on the worker thread; a slightly stale count is fine for metrics

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
