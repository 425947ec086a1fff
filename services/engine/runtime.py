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
    loaded = load_model(resolve_model(settings.model), progress=progress)
    engine = Engine(
        LlamaModel(loaded.config, loaded.weights),
        model_id=loaded.model_id,
        kv_capacity_tokens=settings.kv_capacity_tokens,
        page_size=settings.block_size,
        prefill_chunk_tokens=settings.prefill_chunk_tokens,
    )
    log.info(
        "engine ready: model %s, %d KV pages of %d tokens (%.2f GB)",
        loaded.model_id, engine.cache.pages.num_pages, settings.block_size,
        engine.cache.pool.numel() * engine.cache.pool.element_size() / 1e9,
    )
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
