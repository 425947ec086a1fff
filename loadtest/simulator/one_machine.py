"""The live setup of one machine, step by step: what ``sim_vs_live.py`` compares with a replay.

``crescent up`` on one machine serves with one aggregated engine (``--aggregated 1``) or with
one prefill and one decode engine (``--aggregated 0``). Given the requests a live replay sent
(arrival, prompt tokens, the cached tokens the server reported, output tokens), this runs them
through the step plans the live engines use and times every step with the profiled cost models:

- **aggregated** (``services/aggregated/batcher.py``): each step runs every decoding sequence
  (up to ``max_batch``, first come first served) and up to ``chunk_tokens`` prompt tokens from
  the queued prompts, oldest first; a chunk that does not end its prompt ends on a block
  boundary. A prompt's first token is out when the step with its last chunk ends (sampled before
  the next step runs), and it decodes from the step after next (its handover to the decode loop
  happens while the next step runs). Steps cost ``MixedStepCostModel``.
- **pools** (``services/prefill/batcher.py``, the decode batcher): a prefill step takes each
  queued prompt's next chunk of up to ``prefill_chunk_tokens``, oldest first, within
  ``max_batch_tokens`` (0: one prompt per step; the oldest always runs); a prompt's first token
  is out when the step with its last chunk ends, and its KV then moves to decode (the transfer
  model), where continuous batching runs decode steps. Prefill steps cost the prefill model with
  one fixed cost per step, or ``prefill_beside_decode`` (prefill timed on the threads decode
  leaves it) for a step that starts while decode has sequences; decode steps the decode model.

The prefix cache is what the server reported: a request computes its prompt less its cached
tokens, so the comparison tests the cost models and the queueing, not a cache model. One instance
per role, so placement is trivial, and admission is the live run's: requests it refused are not
replayed. Not modelled: decode's steps slowed by a prefill beside them (TTFT does not wait for
them), the gateway's, scheduler's and gRPC's time per request and the Python time of each live
step around its forward pass (sampling, streaming).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from crescent.services.aggregated.config import AggregatedSettings
from crescent.services.engine.settings import EngineSettings
from crescent.services.prefill.config import PrefillSettings
from crescent.services.scheduler.cost_model import CostModels, MixedStepCostModel


def _live_default(settings: type, name: str) -> int:
    """A live setting's default, so the simulated engines follow it when it changes."""
    return settings.model_fields[name].default


@dataclass(frozen=True, slots=True)
class ReplayedRequest:
    """One request as the live replay sent it."""

    index: int
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class AggregatedSetup:
    """The aggregated engine's settings that shape its steps (``crescent serve aggregated``)."""

    chunk_tokens: int = _live_default(AggregatedSettings, "chunk_tokens")
    block_size: int = _live_default(EngineSettings, "block_size")
    max_batch: int = _live_default(EngineSettings, "max_batch_size")


@dataclass(frozen=True, slots=True)
class PoolsSetup:
    """The prefill and decode engines' settings that shape their steps."""

    prefill_chunk_tokens: int = _live_default(EngineSettings, "prefill_chunk_tokens")
    max_batch_tokens: int = _live_default(PrefillSettings, "max_batch_tokens")
    max_batch: int = _live_default(EngineSettings, "max_batch_size")  # decode's


class _Job:
    """A request on its way through the engine(s)."""

    __slots__ = ("req", "computed", "generated")

    def __init__(self, req: ReplayedRequest, block_size: int = 1) -> None:
        self.req = req
        # A prefix hit attaches whole blocks, and the last prompt token is always computed.
        cached = min(max(req.cached_tokens, 0), req.prompt_tokens - 1)
        self.computed = cached - cached % block_size
        self.generated = 0

    @property
    def context(self) -> int:
        """Tokens a decode step attends to for this sequence (its new token included)."""
        return self.req.prompt_tokens + self.generated


def _check(requests: Sequence[ReplayedRequest]) -> list[ReplayedRequest]:
    for r in requests:
        if r.prompt_tokens < 1 or r.output_tokens < 1:
            raise ValueError(f"request {r.index}: needs at least one prompt and one output token, got "
                             f"{r.prompt_tokens} and {r.output_tokens}")
    return sorted(requests, key=lambda r: (r.arrival_s, r.index))


def aggregated_chunks(prompts: Sequence[_Job], chunk_tokens: int, block_size: int) -> list[tuple[_Job, int]]:
    """(prompt, compute up to) pairs of the next step, as ``MixedBatcher._plan_chunks`` plans them."""
    budget = max(block_size, chunk_tokens - chunk_tokens % block_size)
    chunks: list[tuple[_Job, int]] = []
    for job in prompts:
        if budget < block_size:
            break
        end = min(job.req.prompt_tokens, job.computed + budget)
        if end < job.req.prompt_tokens:
            end -= end % block_size
            if end <= job.computed:
                break
        chunks.append((job, end))
        budget -= end - job.computed
    return chunks


def prefill_chunks(prompts: Sequence[_Job], chunk_tokens: int, max_batch_tokens: int) -> list[tuple[_Job, int]]:
    """(prompt, compute up to) pairs of the next prefill step, as ``prefill.batcher.plan_step``
    plans them when KV pages are plentiful."""
    step: list[tuple[_Job, int]] = []
    tokens = 0
    for job in prompts:
        end = min(job.req.prompt_tokens, job.computed + chunk_tokens)
        size = end - job.computed
        if step and tokens + size > max_batch_tokens:
            continue
        step.append((job, end))
        tokens += size
    return step


def simulate_aggregated(requests: Sequence[ReplayedRequest], model: MixedStepCostModel,
                        setup: AggregatedSetup = AggregatedSetup()) -> dict[int, float]:
    """Each request's simulated TTFT in seconds, by index, on one aggregated engine."""
    arrivals = _check(requests)
    prompts: list[_Job] = []
    decoding: list[_Job] = []  # first come first served; the first max_batch run each step
    joining: list[_Job] = []   # prompts done in the last step: handed over while the next one runs
    ttft: dict[int, float] = {}
    now, next_arrival = 0.0, 0
    while next_arrival < len(arrivals) or prompts or decoding or joining:
        if not prompts and not decoding and not joining:  # idle until the next request
            now = max(now, arrivals[next_arrival].arrival_s)
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival_s <= now:
            prompts.append(_Job(arrivals[next_arrival], setup.block_size))
            next_arrival += 1
        chunks = aggregated_chunks(prompts, setup.chunk_tokens, setup.block_size)
        batch = decoding[: setup.max_batch]
        if chunks or batch:
            now += model.step_seconds([(end - job.computed, job.computed) for job, end in chunks],
                                      len(batch), sum(job.context for job in batch))
        for job in batch:
            job.generated += 1
            if job.generated >= job.req.output_tokens:
                decoding.remove(job)
        # The live batcher queues its next step before a finished prompt's request is handed
        # over to its decode loop, so that request decodes from the step after next (or at once
        # when the engine would otherwise be idle).
        decoding.extend(joining)
        joining = []
        for job, end in chunks:
            job.computed = end
            if end == job.req.prompt_tokens:  # its first token is sampled from this step's logits
                prompts.remove(job)
                ttft[job.req.index] = now - job.req.arrival_s
                job.generated = 1
                if job.req.output_tokens > 1:
                    joining.append(job)
    return ttft


def simulate_pools(requests: Sequence[ReplayedRequest], costs: CostModels,
                   setup: PoolsSetup = PoolsSetup()) -> dict[int, float]:
    """Each request's simulated TTFT in seconds, by index, on one prefill and one decode engine."""
    return _Pools(costs, setup).run(_check(requests))


class _Pools:
    _ARRIVE, _PREFILL_DONE, _HANDOFF_DONE, _DECODE_DONE = range(4)

    def __init__(self, costs: CostModels, setup: PoolsSetup) -> None:
        self.costs, self.setup = costs, setup
        self.now = 0.0
        self.events: list[tuple[float, int, int, object]] = []
        self.order = itertools.count()
        self.prompts: list[_Job] = []
        self.prefill_busy = self.decode_busy = False
        self.decoding: list[_Job] = []
        self.ttft: dict[int, float] = {}

    def _at(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self.order), kind, payload))

    def run(self, arrivals: Sequence[ReplayedRequest]) -> dict[int, float]:
        for req in arrivals:
            self._at(req.arrival_s, self._ARRIVE, req)
        while self.events:
            self.now = self.events[0][0]
            while self.events and self.events[0][0] == self.now:  # all that happens at once, then the next steps
                _, _, kind, payload = heapq.heappop(self.events)
                if kind == self._ARRIVE:
                    self.prompts.append(_Job(payload))  # type: ignore[arg-type]
                elif kind == self._PREFILL_DONE:
                    self._prefill_done(payload)  # type: ignore[arg-type]
                elif kind == self._HANDOFF_DONE:
                    self.decoding.append(payload)  # type: ignore[arg-type]
                else:
                    self._decode_done(payload)  # type: ignore[arg-type]
            self._start_steps()
        return self.ttft

    def _start_steps(self) -> None:
        if not self.prefill_busy and self.prompts:
            chunks = prefill_chunks(self.prompts, self.setup.prefill_chunk_tokens, self.setup.max_batch_tokens)
            # Decode stepping on the same cores leaves prefill fewer threads (when profiled so).
            contended = self.decode_busy or bool(self.decoding)
            p = self.costs.prefill_beside_decode if contended and self.costs.prefill_beside_decode else self.costs.prefill
            seconds = p.fixed_s + sum(p.seconds(end - job.computed, job.computed) - p.fixed_s for job, end in chunks)
            self.prefill_busy = True
            self._at(self.now + seconds, self._PREFILL_DONE, chunks)
        if not self.decode_busy and self.decoding:
            batch = self.decoding[: self.setup.max_batch]
            self.decode_busy = True
            self._at(self.now + self.costs.decode.step_seconds(len(batch), sum(j.context for j in batch)),
                     self._DECODE_DONE, batch)

    def _prefill_done(self, chunks: list[tuple[_Job, int]]) -> None:
        self.prefill_busy = False
        for job, end in chunks:
            job.computed = end
            if end < job.req.prompt_tokens:
                continue
            self.prompts.remove(job)
            self.ttft[job.req.index] = self.now - job.req.arrival_s  # prefill samples and sends the first token
            job.generated = 1
            if job.req.output_tokens > 1:
                self._at(self.now + self.costs.transfer.seconds(job.req.prompt_tokens), self._HANDOFF_DONE, job)

    def _decode_done(self, batch: list[_Job]) -> None:
        self.decode_busy = False
        for job in batch:
            job.generated += 1
            if job.generated >= job.req.output_tokens:
                self.decoding.remove(job)
