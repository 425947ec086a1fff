"""What a serving process wraps around an ``Engine``: loading it, and one worker thread.

Engine calls block for milliseconds to seconds, so they run on one dedicated thread (the engine
is not thread-safe, and torch already uses the cores); the asyncio loop stays free for gRPC.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import torch

from crescent.services.engine.engine import Engine
from crescent.services.engine.llama import LlamaModel
from crescent.services.engine.loader import load_model
from crescent.services.engine.model_source import resolve_model
from crescent.services.engine.settings import EngineSettings

log = logging.getLogger(__name__)

P = ParamSpec("P")
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
    """Runs engine calls one at a time on a dedicated thread; ``pending`` counts waiting calls."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.pending = 0

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(*args, **kwargs))
        finally:
            self.pending -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
