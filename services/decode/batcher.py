"""Continuous batching with admission that keeps its promises.

A handed-off request is *accepted* as soon as it could ever fit (its reservation, prompt +
max_tokens pages, is no larger than the whole cache). It then waits, FIFO, with its KV payload
in host memory, until the pages it will ever need are free of other promises; only then is it
*admitted*: its KV goes into the cache and the pages for the rest of its life are reserved, so
no decode step can run out of pages for it. Admission happens between steps.

One asyncio task owns the running set. Each step runs the next token of up to
``max_batch_size`` admitted requests in one forward pass on the engine worker, samples, and
pushes the tokens to each request's queue, which its StreamTokens call drains. If a step
raises, its sequences run again one by one, so only a broken sequence ends (with an error).
Finished and aborted requests give their pages back at once.

A request with ``n > 1`` choices is admitted as one: its reservation is the prompt's full
pages once plus each choice's own pages (partial page copy and output), and its choices join
the batch as sequences of their own. A choice that ends (or that the gateway aborts alone)
gives back its own pages at once; the shared ones go with the last.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from crescent.services.common.metrics import EngineMetrics, engine_metrics
from crescent.services.common.tasks import cancel_and_wait
from crescent.services.contract.finish import finish_reason
from crescent.services.decode.admission import KvLedger
from crescent.services.decode.request import ABORTED, DRAINING, ERROR, Choice, DecodeRequest, TokenUpdate
from crescent.services.engine.constraints import ConstraintError, submit_masks
from crescent.services.engine.engine import Engine, Sequence
from crescent.services.engine.kv_cache import CacheFullError
from crescent.services.engine.logprobs import TokenLogprob, token_logprob
from crescent.services.instance.runtime import EngineWorker
from crescent.services.engine.sampler import SamplingConfig, sample_batch

log = logging.getLogger(__name__)

__all__ = ["ABORTED", "DRAINING", "ERROR", "Batcher", "Choice", "DecodeRequest", "TokenUpdate"]


@dataclass(frozen=True, slots=True)
class Sampled:
    """A row's result of a step: its token, and its log-probabilities when it asked."""

    token_id: int
    logprob: TokenLogprob | None = None


def adopt_choices(engine: Engine, request: DecodeRequest, payloads: list[torch.Tensor]) -> list[Sequence]:
    """The request's sequences (engine thread): the first choice adopts the prompt's KV, the
    others fork it. Raises ``CacheFullError`` when the pages are not there; nothing is held then."""
    first, *others = request.open_choices
    seq_id = request.request_id if not others else f"{request.request_id}/{first.index}"
    seq = engine.adopt_sequence(seq_id, first.token_ids, request.prompt_tokens, payloads,
                                reserve_tokens=request.reserve_tokens)
    seqs = [seq]
    try:
        for choice in others:
            seqs.append(engine.fork_sequence(seq, f"{request.request_id}/{choice.index}", choice.token_ids[-1],
                                             reserve_tokens=request.reserve_tokens))
    except BaseException:
        for s in seqs:
            engine.release(s)
        raise
    return seqs


def release_all(engine: Engine, seqs: list[Sequence]) -> None:
    for seq in seqs:
        engine.release(seq)


def forward_and_sample(engine: Engine, seqs: list[Sequence], cfgs: list[SamplingConfig],
                       steps: list[int], masks: Future[list[torch.Tensor | None]] | None = None
                       ) -> list[Sampled | Exception]:
    """One decode step (engine thread): a token per sequence, or the exception its sampling raised.
    ``masks`` (constrained rows) are computed on other threads while the forward runs."""
    return sample_rows(engine.decode_step(seqs), seqs, cfgs, steps, masks)


def sample_rows(logits: torch.Tensor, seqs: list[Sequence], cfgs: list[SamplingConfig], steps: list[int],
                masks: Future[list[torch.Tensor | None]] | None = None) -> list[Sampled | Exception]:
    """A token for each sequence's row of ``logits``, or the exception its sampling raised."""
    histories = [seq.token_ids for seq in seqs]
    allowed = masks.result() if masks is not None else None
    try:
        tokens: list[int | Exception] = list(sample_batch(logits, cfgs, steps, histories, allowed))
    except Exception:  # noqa: BLE001 - find the row that fails; the others keep their token
        tokens = []
        for i in range(len(seqs)):
            try:
                row_mask = [allowed[i]] if allowed is not None else None
                tokens.append(sample_batch(logits[i : i + 1], cfgs[i : i + 1], steps[i : i + 1],
                                           histories[i : i + 1], row_mask)[0])
            except Exception as exc:  # noqa: BLE001 - ends only this request
                tokens.append(exc)
    out: list[Sampled | Exception] = []
    for i, (token, cfg) in enumerate(zip(tokens, cfgs)):
        if isinstance(token, Exception):
            out.append(token)
        else:
            out.append(Sampled(token, token_logprob(logits[i], token, cfg.logprobs) if cfg.logprobs is not None
                               else None))
    return out


class Batcher:
    def __init__(self, engine: Engine, worker: EngineWorker, max_batch_size: int, unclaimed_timeout_s: float,
                 metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.worker = worker
        self.max_batch_size = max_batch_size
        self.unclaimed_timeout_s = unclaimed_timeout_s
        self.ledger = KvLedger(engine.cache.pages.num_pages, engine.block_size)
        self.requests: dict[str, DecodeRequest] = {}    # everything held, in arrival order
        self.waiting: deque[DecodeRequest] = deque()     # accepted, not admitted yet (FIFO)
        self.running: list[DecodeRequest] = []           # admitted (KV in the cache), in admission order
        self.left: list[str] = []                        # ids that left since the last load report
        self.draining = False
        self.on_change: Callable[[], object] = lambda: None  # a request arrived or left: tell the scheduler
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.metrics = metrics or engine_metrics("decode")
        self.metrics.kv_capacity_tokens.labels("decode").set(engine.cache.capacity_tokens)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="decode-batcher")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for request in list(self.requests.values()):
            self.abort(request.request_id, "shutdown")

    # ---- what the servicer calls ---------------------------------------------------------

    def holds(self, request_id: str) -> bool:
        """Whether the id is in use here (its record or its pages are not gone yet)."""
        return request_id in self.requests or request_id in self.ledger.admitted or request_id in self.ledger.waiting

    def never_fits(self, prompt_tokens: int, reserve_tokens: int, choices: int = 1) -> bool:
        return self.ledger.pages_for_choices(prompt_tokens, reserve_tokens, choices) > self.ledger.num_pages

    def accept(self, request: DecodeRequest) -> None:
        """Take a request; it waits for its reservation (FIFO) and joins the batch between steps."""
        assert request.request_id not in self.requests, request.request_id
        choices = len(request.choices)
        assert choices and not self.never_fits(request.prompt_tokens, request.reserve_tokens, choices), \
            "the servicer refuses what can never fit"
        self.requests[request.request_id] = request
        self.ledger.wait(request.request_id,
                         self.ledger.pages_for_choices(request.prompt_tokens, request.reserve_tokens, choices))
        self.waiting.append(request)
        self._wake.set()
        self._update_gauges()
        self.on_change()

    def abort(self, request_id: str, why: str) -> bool:
        """Drop a request and free its KV now; False when it is not here. A reader still
        streaming it gets ABORTED."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.left.append(request_id)
        if not request.finished:
            log.info("aborting %s: %s", request_id, why)
            request.queue.put_nowait(TokenUpdate((), ABORTED, why))
            self.metrics.requests.labels("decode", "aborted").inc()
            self._finish(request)
        else:
            self.on_change()
        self._update_gauges()
        return True

    def abort_choice(self, request_id: str, index: int, why: str) -> bool:
        """End one choice of a request and free its own KV now (the gateway found a stop string
        in it); ending the last open choice ends the stream like a finish (nothing more is sent
        for the choice). False when the request is not here."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        choice = request.choice(index)
        if choice is None or choice.finished or request.finished:
            return True
        log.info("ending choice %d of %s: %s", index, request_id, why)
        if len(request.open_choices) == 1:  # the others finished: the stream ends, as after a finish
            choice.finished = True
            request.queue.put_nowait(TokenUpdate((), None, index=index, last=True))
            self.metrics.requests.labels("decode", "aborted").inc()
            self._finish(request)
        else:
            self._end_choice(request, choice)
        self._update_gauges()
        return True

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record once its stream has read everything."""
        request = self.requests.get(request_id)
        if request is not None and request.finished:
            del self.requests[request_id]
            self.left.append(request_id)
            self.on_change()

    def end_all(self, ending: str, why: str) -> None:
        """End every request still generating (the drain ran out of time)."""
        for request in [r for r in self.requests.values() if not r.finished]:
            log.warning("ending %s: %s", request.request_id, why)
            request.queue.put_nowait(TokenUpdate((), ending, why))
            self.metrics.requests.labels("decode", "error").inc()
            self._finish(request)
        self._update_gauges()

    # ---- what the scheduler hears ----------------------------------------------------------

    @property
    def free_kv_tokens(self) -> int:
        """Capacity not promised to any request held here (waiting ones included)."""
        return self.ledger.free_tokens

    def drain_left(self) -> list[str]:
        left, self.left = self.left, []
        return left

    # ---- the loop --------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await self._next()
            except Exception:  # noqa: BLE001 - the loop must outlive a bug, or every request would stall
                log.exception("decode loop failed; carrying on")
                await asyncio.sleep(0.1)

    async def _next(self) -> None:
        """Admit what fits, then run one step (or wait for work)."""
        self._expire_unclaimed()
        await self._admit_waiting()
        batch = self.open_sequences()[: self.max_batch_size]
        self._update_gauges()
        if self._idle(batch):
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            except TimeoutError:
                pass
            return
        await self._step(batch)

    def _idle(self, batch: list[tuple[DecodeRequest, Choice]]) -> bool:
        """Nothing for the next step to run."""
        return not batch

    async def _admit_waiting(self) -> None:
        """Move waiting requests, oldest first, into the cache while their reservations fit."""
        while self.waiting and self.ledger.fits_now(self.waiting[0].request_id):
            request = self.waiting.popleft()
            self.ledger.admit(request.request_id)
            payloads, request.payloads = request.payloads, None
            choices = request.open_choices
            try:
                seqs = await self.worker.run(adopt_choices, self.engine, request, payloads)
            except CacheFullError:  # the ledger and the cache disagree: wait for pages, do not fail it
                log.exception("admitting %s: the cache had fewer pages than promised; it waits", request.request_id)
                if request.finished:
                    self._release(request)
                    continue
                self.ledger.unadmit(request.request_id)
                request.payloads = payloads
                self.waiting.appendleft(request)
                return
            except Exception as exc:  # noqa: BLE001 - a bad payload ends only this request
                log.exception("admitting %s failed", request.request_id)
                if not request.finished:
                    request.queue.put_nowait(TokenUpdate((), ERROR, f"could not load its KV: {exc}"))
                    self.metrics.requests.labels("decode", "error").inc()
                    request.finished = True
                self._release(request)  # the engine gave its pages back; this returns the promise
                continue
            for choice, seq in zip(choices, seqs):
                choice.seq = seq
            if request.finished:  # aborted while its KV was being loaded
                self._release(request)
                continue
            for choice in choices:
                if choice.finished:  # this choice alone was aborted meanwhile
                    self._release_seqs(choice)
            self.running.append(request)

    def open_sequences(self) -> list[tuple[DecodeRequest, Choice]]:
        """Every admitted choice still generating, in admission order."""
        return [(r, c) for r in self.running if not r.finished for c in r.choices if not c.finished]

    async def _step(self, batch: list[tuple[DecodeRequest, Choice]]) -> None:
        start = time.perf_counter()
        try:
            results = await self._run(batch)
        except Exception:  # noqa: BLE001 - isolate: one sequence's failure must not end the others
            log.exception("decode step of %d sequences failed; running them one by one", len(batch))
            results = []
            for request, choice in batch:
                if request.finished or choice.finished:  # aborted meanwhile: its sequence is gone
                    results.append(RuntimeError("ended"))
                    continue
                try:
                    results += await self._run([(request, choice)])
                except Exception as exc:  # noqa: BLE001 - ends only this request
                    results.append(exc)
        self.metrics.step_seconds.labels("decode").observe(time.perf_counter() - start)
        self.metrics.batch_size.labels("decode").observe(len(batch))
        for (request, choice), result in zip(batch, results):
            if request.finished or choice.finished:
                continue  # aborted while the step ran; its pages are already released
            if isinstance(result, Exception):
                log.error("decode step failed for %s: %r", request.request_id, result)
                self._fail(request, f"decode step failed: {result}")
                continue
            self._take(request, choice, result)

    def _take(self, request: DecodeRequest, choice: Choice, result: Sampled) -> None:
        """A choice's new token: streamed, and the choice ended when it stops it."""
        token = result.token_id
        if choice.constraint is not None:
            try:
                choice.constraint.advance(token)
            except ConstraintError as exc:
                log.error("constraint of %s: %s", request.request_id, exc)
                self._fail(request, f"structured output failed: {exc}")
                return
        self.metrics.generated_tokens.labels("decode").inc()
        choice.generated += 1
        assert choice.seq is not None
        reason = finish_reason(token, choice.generated, request.max_tokens, request.stop_token_ids,
                               context_tokens=choice.seq.num_tokens + 1,
                               context_window=self.engine.config.max_position_embeddings)
        logprobs = (result.logprob,) if result.logprob is not None else ()
        last = reason is not None and len(request.open_choices) == 1
        request.queue.put_nowait(TokenUpdate((token,), reason, logprobs=logprobs, index=choice.index, last=last))
        if reason is None:
            choice.seq.token_ids.append(token)
        elif last:
            # The record stays until its stream has read this last update (or expires).
            self.metrics.requests.labels("decode", "ok").inc()
            self._finish(request)
        else:
            self._end_choice(request, choice)

    async def _run(self, batch: list[tuple[DecodeRequest, Choice]]) -> list[Sampled | Exception]:
        return await self.worker.run(forward_and_sample, self.engine, *self._step_inputs(batch))

    @staticmethod
    def _step_inputs(batch: list[tuple[DecodeRequest, Choice]]) -> tuple[list[Sequence], list[SamplingConfig],
                                                                       list[int], Future | None]:
        """The batch's sequences, sampling configs, seeded steps and (constrained rows) masks."""
        constraints = [c.constraint for _, c in batch]
        return ([c.seq for _, c in batch], [c.sampling for _, c in batch],
                [r.first_step + c.generated for r, c in batch],
                submit_masks(constraints) if any(constraints) else None)

    # ---- endings ---------------------------------------------------------------------------

    def _fail(self, request: DecodeRequest, why: str) -> None:
        request.queue.put_nowait(TokenUpdate((), ERROR, why))
        self.metrics.requests.labels("decode", "error").inc()
        self._finish(request)

    def _finish(self, request: DecodeRequest) -> None:
        """The request generates no more: its pages and its promise go back now."""
        request.finished = True
        request.payloads = None
        if request in self.waiting:
            self.waiting.remove(request)
        if any(c.seq is not None for c in request.choices) or request.request_id not in self.ledger.admitted:
            self._release(request)
        # else: it is being admitted right now; _admit_waiting releases it when that returns

    def _end_choice(self, request: DecodeRequest, choice: Choice) -> None:
        """One choice of several generates no more: its own pages and promise go back now."""
        choice.finished = True
        self.ledger.shrink(request.request_id, self.ledger.own_pages(request.prompt_tokens, request.reserve_tokens))
        self._release_seqs(choice)

    def _release(self, request: DecodeRequest) -> None:
        self.ledger.release(request.request_id)
        if request in self.running:
            self.running.remove(request)
        self._release_seqs(*request.choices)

    def _release_seqs(self, *choices: Choice) -> None:
        """The choices' sequences go back to the engine (pages shared with another choice stay)."""
        seqs = [c.seq for c in choices if c.seq is not None]
        for choice in choices:
            choice.seq = None
        if seqs:
            self.worker.submit(release_all, self.engine, seqs, then=self._after_release)
        else:
            self._after_release()
        self._wake.set()  # a waiting request may fit now

    def _after_release(self) -> None:
        self._update_gauges()
        self.on_change()

    def _expire_unclaimed(self) -> None:
        now = time.monotonic()
        for request in list(self.requests.values()):
            if not request.claimed and now - request.received_at > self.unclaimed_timeout_s:
                self.abort(request.request_id, f"nobody streamed it within {self.unclaimed_timeout_s:g} s")

    def _update_gauges(self) -> None:
        pages = self.engine.cache.pages
        self.metrics.kv_used_tokens.labels("decode").set((pages.num_pages - pages.free_pages) * self.engine.block_size)
        running = len(self.open_sequences())
        in_step = min(running, self.max_batch_size)
        self.metrics.running.labels("decode").set(in_step)
        self.metrics.queue_depth.labels("decode").set(len(self.waiting) + running - in_step)
