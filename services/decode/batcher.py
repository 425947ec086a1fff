"""Continuous batching: requests join and leave between decode steps.

One asyncio task owns the running set. Each step runs every running sequence's next token in
one forward pass on the engine worker, samples, and pushes the tokens to each request's queue,
which its StreamTokens call drains. Finished and aborted requests leave between steps and give
their pages back at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from crescent.services.common.metrics import engine_metrics
from crescent.services.common.tasks import cancel_and_wait
from crescent.services.engine.engine import Engine, Sequence
from crescent.services.engine.runtime import EngineWorker
from crescent.services.engine.sampler import SamplingConfig, sample_batch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TokenUpdate:
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop", "length", or None while running


@dataclass(slots=True)
class DecodeRequest:
    request_id: str
    seq: Sequence
    sampling: SamplingConfig
    max_tokens: int
    stop_token_ids: frozenset[int]
    generated: int = 1  # the first token came from prefill
    queue: asyncio.Queue[TokenUpdate] = field(default_factory=asyncio.Queue)
    claimed: bool = False
    admitted_at: float = field(default_factory=time.monotonic)
    finished: bool = False


class Batcher:
    def __init__(self, engine: Engine, worker: EngineWorker, max_batch_size: int, unclaimed_timeout_s: float) -> None:
        self.engine = engine
        self.worker = worker
        self.max_batch_size = max_batch_size
        self.unclaimed_timeout_s = unclaimed_timeout_s
        self.requests: dict[str, DecodeRequest] = {}
        self.on_kv_freed: Callable[[], object] = lambda: None  # e.g. tell the scheduler at once
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.metrics = engine_metrics("decode")
        self.metrics.kv_capacity_tokens.labels("decode").set(engine.cache.capacity_tokens)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="decode-batcher")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        for request in list(self.requests.values()):
            await self.abort(request.request_id, "shutdown")

    def admit(self, request: DecodeRequest) -> None:
        self.requests[request.request_id] = request
        self._wake.set()

    async def abort(self, request_id: str, why: str) -> None:
        """Drop a request and free its KV now (client gone, nobody streaming, shutdown)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.finished:
            return  # its pages went back when it finished; only the record was left
        log.info("aborting %s: %s", request_id, why)
        request.finished = True
        self.worker.submit(self.engine.release, request.seq, then=self.on_kv_freed)
        self.metrics.requests.labels("decode", "aborted").inc()
        self._update_gauges()

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record once its stream has read everything."""
        request = self.requests.get(request_id)
        if request is not None and request.finished:
            del self.requests[request_id]

    def _update_gauges(self) -> None:
        used = self.engine.cache.capacity_tokens - self.engine.cache.pages.free_pages * self.engine.page_size
        self.metrics.kv_used_tokens.labels("decode").set(used)
        active = sum(not r.finished for r in self.requests.values())
        self.metrics.running.labels("decode").set(min(active, self.max_batch_size))
        self.metrics.queue_depth.labels("decode").set(max(0, active - self.max_batch_size))

    async def _loop(self) -> None:
        while True:
            await self._expire_unclaimed()
            batch = [r for r in self.requests.values() if not r.finished][: self.max_batch_size]
            self._update_gauges()
            if not batch:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                except TimeoutError:
                    pass
                continue
            try:
                await self._step(batch)
            except Exception:
                log.exception("decode step failed; aborting its %d requests", len(batch))
                for request in batch:
                    request.queue.put_nowait(TokenUpdate((), "error"))
                    await self.abort(request.request_id, "step failed")

    async def _step(self, batch: list[DecodeRequest]) -> None:
        start = time.perf_counter()
        seqs = [r.seq for r in batch]
        cfgs = [r.sampling for r in batch]
        steps = [r.generated for r in batch]
        tokens = await self.worker.run(lambda: sample_batch(self.engine.decode_step(seqs), cfgs, steps))
        self.metrics.step_seconds.labels("decode").observe(time.perf_counter() - start)
        self.metrics.batch_size.labels("decode").observe(len(batch))
        self.metrics.generated_tokens.labels("decode").inc(len(batch))
        context_limit = self.engine.config.max_position_embeddings
        for request, token in zip(batch, tokens):
            if request.request_id not in self.requests:
                continue  # aborted while the step ran; its pages are already released
            request.generated += 1
            reason = None
            if token in request.stop_token_ids:
                reason = "stop"
            elif request.generated >= request.max_tokens or request.seq.num_tokens + 1 >= context_limit:
                reason = "length"
            request.queue.put_nowait(TokenUpdate((token,), reason))
            if reason is None:
                request.seq.token_ids.append(token)
            else:
                # The record stays until its stream has read this last update (or expires).
                request.finished = True
                self.worker.submit(self.engine.release, request.seq, then=self.on_kv_freed)
                self.metrics.requests.labels("decode", "ok").inc()

    async def _expire_unclaimed(self) -> None:
        now = time.monotonic()
        for request in list(self.requests.values()):
            if not request.claimed and now - request.admitted_at > self.unclaimed_timeout_s:
                await self.abort(request.request_id, f"nobody streamed it within {self.unclaimed_timeout_s:g} s")
