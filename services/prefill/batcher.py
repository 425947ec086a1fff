"""Prefill batching: chunks of several queued prompts computed in one forward pass.

A prefill instance used to compute one prompt at a time (``Engine.prefill`` behind the engine
worker's queue). With batching on, a prompt whose prefix is attached (local cache, peer pull,
kvstore) joins a queue, and each step runs the next chunk of several queued prompts together
through ``Engine.mixed_step`` with no decode rows: one flat, variable-length batch whose linear
layers run on every token at once and whose attention runs per sequence over its own pages.

Bit for bit what one prompt at a time gives: each prompt is cut into exactly the chunks
``Engine.prefill`` cuts (``prefill_chunk_tokens`` from where its cached prefix ends), and every
row of a mixed step is what it is alone (batch-invariant linear layers, per-sequence attention;
``tests/engine/test_mixed_step.py``). So first tokens and exported KV do not depend on what else
was in the batch. A step holds up to ``max_batch_tokens`` prompt tokens, chunks taken oldest
prompt first; the oldest always runs, so a chunk larger than the budget still runs (alone), and
``max_batch_tokens`` 0 computes one prompt at a time.

Streaming order is kept: a prompt whose last chunk ran is answered at once (its first token
sampled and its handoff started before the next step is queued); the others go on in the next
step. (Before this batcher, each prompt's whole prefill went to the engine thread's queue on
arrival, so a first token's sampling waited behind every prompt queued meanwhile.) A prompt
whose caller left is dropped from the queue before its next chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from crescent.services.common.metrics import EngineMetrics
from crescent.services.engine.engine import Engine, LayerHook, Sequence, prefill_step_end
from crescent.services.instance.runtime import EngineWorker

log = logging.getLogger(__name__)


@dataclass(eq=False)
class QueuedPrompt:
    """A prompt waiting for (the rest of) its prefill; ``done`` gets its last token's logits."""

    seq: Sequence
    done: asyncio.Future[torch.Tensor] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    on_layer: LayerHook | None = None  # a layer-wise handoff's (``Engine.prefill``)


def plan_step(prompts: Iterable[Sequence], chunk_tokens: int, max_batch_tokens: int, free_pages: int,
              block_size: int) -> list[tuple[Sequence, int]]:
    """(sequence, compute up to this token) pairs for one forward.

    Each prompt's next chunk is the one ``Engine.prefill`` would run: up to ``chunk_tokens``
    from where it stands (a moved request's decode tail in one step: ``prefill_step_end``). Chunks are taken oldest prompt first while the step stays within
    ``max_batch_tokens`` tokens and the KV pages they need fit in ``free_pages``; a chunk that
    does not fit is skipped (a later, smaller one may). The oldest prompt's chunk always goes,
    so nothing waits forever; if its pages are not there it fails alone (``CacheFullError``),
    as it would have alone."""
    step: list[tuple[Sequence, int]] = []
    tokens = pages = 0
    for seq in prompts:
        end = prefill_step_end(seq, chunk_tokens)
        size = end - seq.num_computed
        needed = max(0, -(-end // block_size) - len(seq.pages))
        if not step and needed > free_pages:
            return [(seq, end)]  # it fails for want of pages; nothing else shares its step
        if step and (tokens + size > max_batch_tokens or pages + needed > free_pages):
            continue
        step.append((seq, end))
        tokens += size
        pages += needed
    return step


class PrefillBatcher:
    """Owns the queue of prompts to compute and the task that runs their steps."""

    def __init__(self, engine: Engine, worker: EngineWorker, max_batch_tokens: int, metrics: EngineMetrics) -> None:
        if max_batch_tokens < 0:
            raise ValueError(f"max_batch_tokens must be 0 (one prompt per forward) or more, got {max_batch_tokens}")
        self.engine, self.worker, self.metrics = engine, worker, metrics
        self.max_batch_tokens = max_batch_tokens
        self._queue: deque[QueuedPrompt] = deque()  # oldest first
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    async def prefill(self, seq: Sequence, on_layer: LayerHook | None = None) -> torch.Tensor:
        """Compute the prompt's tokens not computed yet, in steps shared with other queued prompts;
        its last token's logits (vocab,). Cancelled: no further chunk of it is computed.
        ``on_layer(layer, end)``: called on the engine thread as in ``Engine.prefill``."""
        job = QueuedPrompt(seq, on_layer=on_layer)
        self._queue.append(job)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._run_steps(), name="prefill-batcher")
        self._wake.set()
        try:
            return await job.done
        finally:
            if job in self._queue:  # the caller left before its prompt completed
                self._queue.remove(job)

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for job in self._queue:
            if not job.done.done():
                job.done.cancel()
        self._queue.clear()

    # ---- the loop -------------------------------------------------------------------------------

    async def _run_steps(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                await asyncio.sleep(0)  # prompts whose prefix was attached in this same turn join the first step
                while self._queue:
                    await self._step()
                    # Prompts answered by this step sample their first tokens (and start their
                    # handoffs) on the engine thread before the next step is queued behind them.
                    await asyncio.sleep(0)
        except Exception as exc:  # noqa: BLE001 - a bug here: the waiting prompts fail rather than hang
            log.exception("the prefill batcher stopped; the next prompt starts it again")
            for job in list(self._queue):
                self._finish(job, error=exc)

    async def _step(self) -> None:
        pages = self.engine.cache.pages
        step = plan_step((job.seq for job in self._queue), self.engine.prefill_chunk_tokens, self.max_batch_tokens,
                         pages.unpromised_pages, self.engine.block_size)
        jobs = [next(job for job in self._queue if job.seq is seq) for seq, _ in step]
        hooked = [(job.on_layer, end) for job, (_, end) in zip(jobs, step) if job.on_layer is not None]

        def on_layer(layer: int) -> None:  # on the engine thread
            for hook, end in hooked:
                hook(layer, end)

        try:
            if hooked:
                prompt_logits, _ = await self.worker.run(self.engine.mixed_step, step, [], on_layer=on_layer)
            else:
                prompt_logits, _ = await self.worker.run(self.engine.mixed_step, step, [])
        except Exception as exc:  # noqa: BLE001 - handed to each prompt of the step, whose call ends with it
            log.warning("prefill step of %d prompts failed: %s", len(jobs), exc)
            for job in jobs:
                self._finish(job, error=exc)
            return
        self.metrics.batch_size.labels("prefill").observe(len(jobs))
        for job, logits in zip(jobs, prompt_logits):
            if logits is not None:
                self._finish(job, logits=logits)

    def _finish(self, job: QueuedPrompt, *, logits: torch.Tensor | None = None, error: Exception | None = None) -> None:
        if job in self._queue:
            self._queue.remove(job)
        if job.done.done():  # cancelled meanwhile
            return
        if error is not None:
            job.done.set_exception(error)
        else:
            job.done.set_result(logits)
