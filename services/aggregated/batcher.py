"""The aggregated instance's batcher: the decode batcher plus prompts, mixed into its steps.

A prompt placed here first reserves, in the decode ledger, all the KV its request may ever hold
(``reserve_prompt``; FIFO with the handoffs waiting here), so what was accepted never waits for
pages it was promised. Its tokens are then computed in chunks: each step runs every decoding
sequence's next token and up to ``chunk_tokens`` prompt tokens, taken from the queued prompts
oldest first (several short prompts share a step), in one forward (``Engine.mixed_step``;
every row is bitwise what it is alone). A decode step never waits for a whole prompt, and a
prompt never waits for decode to go idle.

When a prompt completes, prefill's servicer samples its first tokens and hands the request over
locally (``accept`` with ``local_prompt``): its choices fork the prompt's sequence (full pages
shared, the last partial page copied) under the reservation made at the start; no KV is copied
out or in. A request placed to decode elsewhere hands off over gRPC as from a prefill instance,
and its reservation here ends with its Prefill call.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from crescent.services.decode.batcher import Batcher, Sampled, release_all, sample_rows
from crescent.services.decode.request import ERROR, Choice, DecodeRequest, TokenUpdate
from crescent.services.engine.engine import Engine, Sequence, prefill_step_end
from crescent.services.instance.runtime import EngineWorker

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PromptJob:
    """A prompt being computed in chunks; ``done`` gets its last token's logits."""

    seq: Sequence
    done: asyncio.Future[torch.Tensor] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def fork_choices(engine: Engine, request: DecodeRequest) -> list[Sequence]:
    """The request's sequences (engine thread), each a fork of the prompt prefilled here."""
    prompt = request.local_prompt
    assert prompt is not None
    choices = request.open_choices
    seqs: list[Sequence] = []
    try:
        for choice in choices:
            seq_id = request.request_id if len(choices) == 1 else f"{request.request_id}/{choice.index}"
            seqs.append(engine.fork_sequence(prompt, seq_id, choice.token_ids[-1], reserve_tokens=request.reserve_tokens))
    except BaseException:
        release_all(engine, seqs)
        raise
    return seqs


class MixedBatcher(Batcher):
    def __init__(self, engine: Engine, worker: EngineWorker, max_batch_size: int, unclaimed_timeout_s: float,
                 chunk_tokens: int) -> None:
        super().__init__(engine, worker, max_batch_size, unclaimed_timeout_s)
        block_size = engine.block_size
        self.chunk_tokens = max(block_size, chunk_tokens - chunk_tokens % block_size)  # chunks end on block boundaries
        self.prompts: deque[PromptJob] = deque()          # being computed, oldest first
        self._reserving: deque[tuple[str, asyncio.Future[None]]] = deque()  # prompts waiting for KV room
        self._reserved: set[str] = set()                  # prompts holding a reservation, not handed over
        self._adopting: deque[DecodeRequest] = deque()    # handed over locally, choices not forked yet

    # ---- what prefill's servicer calls --------------------------------------------------------

    def prompt_pages(self, prompt_tokens: int, reserve_tokens: int, choices: int) -> int:
        """A prompt's reservation: its request's decode reservation, plus the page its choices'
        copies of the last partial page take while the prompt's own is still held."""
        return self.ledger.pages_for_choices(prompt_tokens, reserve_tokens, choices) + 1

    async def reserve_prompt(self, request_id: str, pages: int) -> None:
        """Wait until the prompt's reservation fits (FIFO); cancelled: nothing stays reserved."""
        assert pages <= self.ledger.num_pages, "the servicer refuses what can never fit"
        self.ledger.wait(request_id, pages)
        ready = asyncio.get_running_loop().create_future()
        self._reserving.append((request_id, ready))
        self._reserved.add(request_id)
        self._wake.set()
        self.on_change()
        try:
            await ready
        except BaseException:
            self.release_prompt(request_id)
            raise

    def release_prompt(self, request_id: str) -> None:
        """The Prefill call ended: a reservation not handed over to a local request goes back."""
        if request_id not in self._reserved:
            return
        self._reserved.discard(request_id)
        self._reserving = deque((r, f) for r, f in self._reserving if r != request_id)
        if request_id in self.ledger.admitted or request_id in self.ledger.waiting:
            self.ledger.release(request_id)
        self._wake.set()
        self._update_gauges()
        self.on_change()

    async def prefill(self, seq: Sequence) -> torch.Tensor:
        """Compute the prompt in chunks mixed into decode steps; its last token's logits."""
        job = PromptJob(seq)
        self.prompts.append(job)
        self._wake.set()
        try:
            return await job.done
        finally:
            if job in self.prompts:  # cancelled (the client left) before it completed
                self.prompts.remove(job)

    def accept(self, request: DecodeRequest) -> None:
        if request.local_prompt is None:
            super().accept(request)
            return
        # Prefilled here under its reservation (admitted in the ledger): its choices fork the prompt.
        assert request.request_id in self._reserved and request.request_id in self.ledger.admitted, request.request_id
        self._reserved.discard(request.request_id)
        self.requests[request.request_id] = request
        self._adopting.append(request)
        self._wake.set()
        self._update_gauges()
        self.on_change()

    # ---- the loop -------------------------------------------------------------------------------

    def _idle(self, batch: list[tuple[DecodeRequest, Choice]]) -> bool:
        return not batch and not self.prompts

    def _update_gauges(self) -> None:
        super()._update_gauges()
        # Prompts without their first token yet: waiting for KV room or for their chunks. Prefill's
        # own gauge counts jobs on the engine thread, which here are mostly decode steps; the
        # chart's autoscalers sum every role's queue depth per pod.
        unanswered = len(self._reserving) + sum(not job.done.done() for job in self.prompts)
        self.metrics.queue_depth.labels("aggregated").set(unanswered)

    async def _admit_waiting(self) -> None:
        await self._adopt_local()
        await super()._admit_waiting()
        while self._reserving and self.ledger.fits_now(self._reserving[0][0]):
            request_id, ready = self._reserving.popleft()
            self.ledger.admit(request_id)
            if not ready.done():
                ready.set_result(None)

    async def _adopt_local(self) -> None:
        while self._adopting:
            request = self._adopting.popleft()
            choices = request.open_choices
            try:
                if not request.finished:
                    seqs = await self.worker.run(fork_choices, self.engine, request)
                    for choice, seq in zip(choices, seqs):
                        choice.seq = seq
            except Exception as exc:  # noqa: BLE001 - the ledger promised these pages: a bug, ends only this one
                log.exception("forking the choices of %s failed", request.request_id)
                if not request.finished:
                    request.queue.put_nowait(TokenUpdate((), ERROR, f"could not start decoding: {exc}"))
                    self.metrics.requests.labels("decode", "error").inc()
                    request.finished = True
            finally:
                request.adopted.set()  # the prompt's own pages may go now
            if request.finished:  # aborted meanwhile (or failed): its promise goes back
                self._release(request)
                continue
            for choice in choices:
                if choice.finished:
                    self._release_seqs(choice)
            self.running.append(request)

    async def _run(self, batch: list[tuple[DecodeRequest, Choice]]) -> list[Sampled | Exception]:
        chunks = self._plan_chunks()
        if not chunks:
            return await super()._run(batch)
        seqs, cfgs, steps, masks = self._step_inputs(batch)
        jobs = [job for job, _ in chunks]

        def mixed() -> tuple[list[torch.Tensor | None], list[Sampled | Exception]]:
            prompt_logits, logits = self.engine.mixed_step([(job.seq, end) for job, end in chunks], seqs)
            return prompt_logits, (sample_rows(logits, seqs, cfgs, steps, masks) if seqs else [])

        try:
            prompt_logits, results = await self.worker.run(mixed)
        except Exception as exc:
            for job in jobs:  # their prompts end with an error; the decode rows are retried alone
                self._drop(job, exc)
            raise
        for job, logits in zip(jobs, prompt_logits):
            if logits is not None:
                self._drop(job, None, logits)
        if any(logits is not None for logits in prompt_logits):
            # Prompts answered by this step queue their first tokens' sampling on the engine
            # thread before the next step is queued: otherwise each first token waits a step more.
            await asyncio.sleep(0)
        return results

    def _plan_chunks(self) -> list[tuple[PromptJob, int]]:
        """(prompt, compute up to) pairs for the next step: up to ``chunk_tokens`` tokens, oldest
        prompts first; a chunk that does not end its prompt ends on a block boundary."""
        budget, block_size, chunks = self.chunk_tokens, self.engine.block_size, []
        for job in self.prompts:
            seq = job.seq
            if job.done.done() or budget < block_size:
                continue
            end = prefill_step_end(seq, budget)
            tail_start = seq.num_tokens - seq.decode_tail
            if end < tail_start:
                end -= end % block_size
                if end <= seq.num_computed:
                    break
            elif end - seq.num_computed > budget and chunks:
                continue  # a moved request's decode tail goes whole (a row per token): next step
            chunks.append((job, end))
            budget -= end - seq.num_computed
        return chunks

    def _drop(self, job: PromptJob, error: Exception | None, logits: torch.Tensor | None = None) -> None:
        if job in self.prompts:
            self.prompts.remove(job)
        if job.done.done():
            return
        if error is not None:
            job.done.set_exception(error)
        else:
            job.done.set_result(logits)
