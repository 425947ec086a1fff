"""``crescent profile``: measure this machine's engine and fit the scheduler's cost models.

Both ways ``crescent up`` serves, each with the threads it gives its engines (``cpu_share``):

- **pools** (one prefill + one decode process): prefill is timed over (prompt length, cached
  prefix length), the prefix computed first so the timed run attaches it from the engine's
  cache, as a prefix hit does in service; decode is timed per step over (batch size, context per
  sequence), the sequences' KV zero-filled rather than computed, since a step's time does not
  depend on the values it reads. When the two processes share too few cores, prefill is timed
  again on the threads decode leaves it (``prefill_beside_decode``): what a prompt costs while
  decode is stepping.
- **aggregated** (one engine doing both): ``Engine.mixed_step`` is timed over (chunk tokens,
  tokens before the chunk, decode batch, context per decoding sequence), the steps an aggregated
  engine runs when it mixes prompt chunks into decode steps.

The fits (``cost_model.fit_prefill_model`` / ``fit_decode_model`` / ``fit_mixed_step_model``)
become a YAML snippet under ``cost:`` that the scheduler's settings file accepts as it is, and
that ``loadtest/sim_vs_live.py --costs`` reads. The engine is built from the same settings as
``crescent up``'s (``--device``, ``--dtype``, ``--kv-cache-dtype``), and the header says which.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import yaml

from crescent.services.engine.device import dtype_name
from crescent.services.engine.engine import Engine
from crescent.services.scheduler.cost_model import (
    DecodeCostModel,
    DecodeSample,
    MixedStepCostModel,
    MixedStepSample,
    PrefillCostModel,
    PrefillSample,
    attention_pairs,
    fit_decode_model,
    fit_mixed_step_model,
    fit_prefill_model,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProfilePlan:
    prefill: tuple[tuple[int, int], ...]    # (prompt tokens, cached prefix tokens)
    decode: tuple[tuple[int, int], ...]     # (batch size, context tokens per sequence)
    decode_steps: int                       # timed steps per decode point (after one warm-up step); median kept
    prefill_repeats: int = 1                # runs per prefill point; the fastest is kept (others' load only adds)
    # (chunk tokens, tokens before the chunk, decode batch, context per decoding sequence); the
    # aggregated engine's mixed steps, each timed decode_steps times (after a warm-up), median kept
    mixed: tuple[tuple[int, int, int, int], ...] = ()

    def kv_tokens_needed(self, block_size: int) -> int:
        prefill = max(p + c for p, c in self.prefill)        # the prefix run and the timed run
        decode = max(b * (c + self.decode_steps + 2) for b, c in self.decode)
        mixed = max((u + c + 1 + b * (ctx + self.decode_steps + 2) for u, c, b, ctx in self.mixed), default=0)
        batch = max([b for b, _ in self.decode] + [b for *_, b, _ in self.mixed])
        return max(prefill, decode, mixed) + 2 * block_size * (batch + 1)

    def points_for(self, modes: Sequence[str], threads: ProfileThreads | None = None) -> int:
        """Measurements in all for these modes (what a progress bar counts)."""
        prefill_runs = 2 if threads and threads.prefill_beside_decode else 1
        pools = prefill_runs * self.prefill_repeats * len(self.prefill) + len(self.decode)
        return (pools if "pools" in modes else 0) + (len(self.mixed) if "aggregated" in modes else 0)

    @property
    def points(self) -> int:
        """Measurements of every mode the plan has points for."""
        return self.points_for(MODES)


MODES = ("pools", "aggregated")


@dataclass(frozen=True, slots=True)
class ProfileThreads:
    """Torch threads per role, as ``crescent up`` gives them (``cpu_share.share_cores``)."""

    prefill: int
    decode: int
    aggregated: int
    prefill_beside_decode: int = 0  # what prefill gets while decode steps on the same cores; 0: not measured


# About a minute for the default model on 2 CPU cores; --quick takes seconds.
DEFAULT_PLAN = ProfilePlan(
    prefill=((128, 0), (512, 0), (1024, 0), (2048, 0), (1024, 512), (2048, 1024), (2048, 1536)),
    decode=((1, 128), (1, 2048), (4, 512), (8, 128), (8, 1024), (16, 256), (16, 512)),
    decode_steps=5,
    prefill_repeats=2,
    mixed=((0, 0, 1, 256), (0, 0, 8, 512), (256, 0, 0, 0), (256, 1024, 0, 0), (64, 0, 4, 256), (128, 512, 1, 1024),
           (256, 0, 4, 512), (256, 512, 8, 256), (256, 1536, 16, 512), (128, 0, 16, 256)),
)
QUICK_PLAN = ProfilePlan(
    prefill=((64, 0), (192, 0), (320, 0), (320, 128), (320, 256)),
    decode=((1, 64), (2, 256), (4, 64), (4, 192)),
    decode_steps=2,
    mixed=((0, 0, 2, 64), (64, 0, 0, 0), (64, 128, 1, 64), (128, 0, 2, 128), (32, 64, 4, 64), (128, 64, 0, 0)),
)


@dataclass(frozen=True, slots=True)
class ProfileResult:
    prefill_samples: tuple[PrefillSample, ...]
    decode_samples: tuple[DecodeSample, ...]
    prefill_model: PrefillCostModel
    decode_model: DecodeCostModel
    kv_bytes_per_token: int
    mixed_samples: tuple[MixedStepSample, ...] = ()
    mixed_model: MixedStepCostModel | None = None
    threads: ProfileThreads | None = None
    prefill_beside_decode_samples: tuple[PrefillSample, ...] = ()
    prefill_beside_decode_model: PrefillCostModel | None = None


class Profiler:
    """Times one engine (not thread-safe, like the engine itself)."""

    def __init__(self, engine: Engine, seed: int = 0) -> None:
        self.engine = engine
        self._rng = random.Random(seed)
        self._runs = 0

    def _tokens(self, n: int) -> list[int]:
        # Fresh random ids for every run, so no run hits another's cached blocks by accident.
        return [self._rng.randrange(3, self.engine.config.vocab_size) for _ in range(n)]

    def _name(self) -> str:
        self._runs += 1
        return f"profile-{self._runs}"

    def prefill(self, prompt_tokens: int, cached_tokens: int) -> PrefillSample:
        """Time the prefill of ``prompt_tokens`` of which the first ``cached_tokens`` are cached."""
        block_size = self.engine.block_size
        if cached_tokens % block_size or cached_tokens >= prompt_tokens:
            raise ValueError(f"cached tokens ({cached_tokens}) must be a multiple of {block_size} below the prompt length")
        tokens = self._tokens(prompt_tokens)
        if cached_tokens:
            prefix = self.engine.add_sequence(self._name(), tokens[:cached_tokens], use_cache=False)
            try:
                self.engine.prefill(prefix)  # registers the prefix blocks in the cache
            finally:
                self.engine.release(prefix)
        seq = self.engine.add_sequence(self._name(), tokens)
        try:
            start = time.perf_counter()
            self.engine.prefill(seq)
            seconds = time.perf_counter() - start
        finally:
            self.engine.release(seq)
        return PrefillSample(new_tokens=prompt_tokens - seq.num_cached, cached_tokens=seq.num_cached, seconds=seconds)

    def decode(self, batch_size: int, context_tokens: int, steps: int) -> DecodeSample:
        """Median time of ``steps`` decode steps of ``batch_size`` sequences with ``context_tokens`` each."""
        engine = self.engine
        seqs: list = []
        try:
            seqs = self._decoding(batch_size, context_tokens)
            times = []
            for _ in range(steps + 1):  # the first step warms up and is not counted
                start = time.perf_counter()
                engine.decode_step(seqs)
                times.append(time.perf_counter() - start)
                for seq in seqs:
                    seq.token_ids.append(self._tokens(1)[0])
        finally:
            for seq in seqs:
                engine.release(seq)
        mean_context = batch_size * (context_tokens + 1 + steps / 2)
        return DecodeSample(batch_size=batch_size, context_tokens=round(mean_context), seconds=statistics.median(times[1:]))

    def _decoding(self, batch_size: int, context_tokens: int) -> list:
        """``batch_size`` sequences with zero-filled KV for ``context_tokens``, each one token to decode."""
        engine, block_size = self.engine, self.engine.block_size
        seqs = []
        try:
            for _ in range(batch_size):
                sizes = [min(block_size, context_tokens - i) for i in range(0, context_tokens, block_size)]
                payloads = [torch.zeros(engine.cache.payload_shape(n), dtype=engine.cache.wire_dtype) for n in sizes]
                seqs.append(engine.adopt_sequence(self._name(), self._tokens(context_tokens + 1), context_tokens, payloads))
        except BaseException:
            for seq in seqs:
                engine.release(seq)
            raise
        return seqs

    def mixed(self, chunk_tokens: int, chunk_context: int, batch_size: int, context_tokens: int, steps: int) -> MixedStepSample:
        """Median time of ``steps`` mixed steps: a ``chunk_tokens`` chunk of a prompt whose first
        ``chunk_context`` tokens are computed, beside ``batch_size`` decoding sequences of
        ``context_tokens`` each (either may be 0, not both)."""
        if chunk_tokens <= 0 and batch_size <= 0:
            raise ValueError("a mixed step needs a prompt chunk or a decode batch")
        engine = self.engine
        seqs: list = []
        try:
            seqs = self._decoding(batch_size, context_tokens) if batch_size else []
            times = []
            for _ in range(steps + 1):  # the first step warms up and is not counted
                chunks, prompt = [], None
                if chunk_tokens:  # one token more than the chunk: it stops mid-prompt, as most chunks do
                    prompt = engine.add_sequence(self._name(), self._tokens(chunk_context + chunk_tokens + 1), use_cache=False)
                    if chunk_context:
                        engine.mixed_step([(prompt, chunk_context)], [])
                    chunks = [(prompt, chunk_context + chunk_tokens)]
                try:
                    start = time.perf_counter()
                    engine.mixed_step(chunks, seqs)
                    times.append(time.perf_counter() - start)
                finally:
                    if prompt is not None:
                        engine.release(prompt)
                for seq in seqs:
                    seq.token_ids.append(self._tokens(1)[0])
        finally:
            for seq in seqs:
                engine.release(seq)
        return MixedStepSample(prompt_tokens=chunk_tokens, attention_pairs=attention_pairs([(chunk_tokens, chunk_context)]),
                               batch_size=batch_size, context_tokens=round(batch_size * (context_tokens + 1 + steps / 2)),
                               seconds=statistics.median(times[1:]))


def run_profile(engine: Engine, plan: ProfilePlan, on_point: Callable[[str], None] = lambda what: None,
                modes: Sequence[str] | None = None, threads: ProfileThreads | None = None) -> ProfileResult:
    """Measure the points of ``plan`` that ``modes`` need (after a warm-up run) and fit their cost
    models; each role runs on its ``threads`` (None: as the engine was built). ``modes`` None:
    every mode the plan has points for."""
    if modes is None:
        modes = MODES if plan.mixed else ("pools",)
    unknown = set(modes) - set(MODES)
    if unknown or not modes:
        raise ValueError(f"unknown profile modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if "aggregated" in modes and not plan.mixed:
        raise ValueError("the plan has no mixed-step points for the aggregated mode")
    before = torch.get_num_threads()
    try:
        pools = _profile_pools(engine, plan, on_point, threads) if "pools" in modes else None
        mixed_samples: tuple[MixedStepSample, ...] = ()
        mixed_model = None
        if "aggregated" in modes:
            if threads:
                torch.set_num_threads(threads.aggregated)
            profiler = Profiler(engine, seed=1)
            profiler.mixed(max(u for u, *_ in plan.mixed), 0, 1, 64, 1)  # warm-up
            samples = []
            for u, c, b, ctx in plan.mixed:
                on_point(f"mixed step: {u}-token chunk after {c}, batch {b} at {ctx} context")
                samples.append(profiler.mixed(u, c, b, ctx, plan.decode_steps))
            mixed_samples, mixed_model = tuple(samples), fit_mixed_step_model(samples)
    finally:
        torch.set_num_threads(before)
    cache = engine.cache
    kv_bytes_per_token = cache.nbytes() // (cache.pages.num_pages * engine.block_size)
    if pools is None:  # aggregated only: a step of one prompt chunk, or of decode rows, alone
        assert mixed_model is not None
        return ProfileResult((), (), mixed_model.prefill_model(), mixed_model.decode_model(), kv_bytes_per_token,
                             mixed_samples, mixed_model, threads)
    prefill, decode, beside = pools
    return ProfileResult(tuple(prefill), tuple(decode), fit_prefill_model(prefill), fit_decode_model(decode),
                         kv_bytes_per_token, mixed_samples, mixed_model, threads,
                         tuple(beside), fit_prefill_model(beside) if beside else None)


def _profile_pools(engine: Engine, plan: ProfilePlan, on_point: Callable[[str], None], threads: ProfileThreads | None
                   ) -> tuple[list[PrefillSample], list[DecodeSample], list[PrefillSample]]:
    if threads:
        torch.set_num_threads(threads.prefill)
    profiler = Profiler(engine)
    profiler.prefill(min(p for p, _ in plan.prefill), 0)  # warm-up: first calls allocate and load code
    prefill = _prefill_points(profiler, plan, on_point, "prefill")
    beside: list[PrefillSample] = []
    if threads and threads.prefill_beside_decode:
        torch.set_num_threads(threads.prefill_beside_decode)
        beside = _prefill_points(profiler, plan, on_point, f"prefill on {threads.prefill_beside_decode} threads")
    if threads:
        torch.set_num_threads(threads.decode)
    decode = []
    for batch, context in plan.decode:
        on_point(f"decode batch {batch}, {context} context tokens each")
        decode.append(profiler.decode(batch, context, plan.decode_steps))
    return prefill, decode, beside


def _prefill_points(profiler: Profiler, plan: ProfilePlan, on_point: Callable[[str], None], label: str) -> list[PrefillSample]:
    # Repeats go round all points in turn, so a burst of load elsewhere cannot spoil every run of one point.
    runs: list[list[PrefillSample]] = [[] for _ in plan.prefill]
    for _ in range(plan.prefill_repeats):
        for i, (prompt, cached) in enumerate(plan.prefill):
            on_point(f"{label} {prompt} tokens, {cached} cached")
            runs[i].append(profiler.prefill(prompt, cached))
    return [min(point_runs, key=lambda sample: sample.seconds) for point_runs in runs]


def engine_placement(engine: Engine) -> str:
    """Where and in which dtypes ``engine`` computes, for the snippet's header: a fit holds there only."""
    model = engine.model
    device, dtype = getattr(model, "device", torch.device("cpu")), getattr(model, "dtype", torch.float32)
    return f"device {device}, dtype {dtype_name(dtype)}, KV cache {dtype_name(engine.cache.wire_dtype)}"


def cost_settings_yaml(result: ProfileResult, header: str = "") -> str:
    """The ``cost:`` section of the scheduler's settings, with the fitted coefficients."""
    p, d, m = result.prefill_model, result.decode_model, result.mixed_model
    doc = {"cost": {
        "prefill": {"fixed_s": _round(p.fixed_s), "per_token_s": _round(p.per_token_s), "attention_s": _round(p.attention_s)},
        "decode": {"fixed_s": _round(d.fixed_s), "per_sequence_s": _round(d.per_sequence_s),
                   "per_context_token_s": _round(d.per_context_token_s)},
        "transfer": {"kv_bytes_per_token": result.kv_bytes_per_token},
    }}
    if result.prefill_beside_decode_model is not None:
        b = result.prefill_beside_decode_model
        doc["cost"]["prefill_beside_decode"] = {
            "fixed_s": _round(b.fixed_s), "per_token_s": _round(b.per_token_s), "attention_s": _round(b.attention_s)}
    if m is not None:
        doc["cost"]["mixed"] = {name: _round(getattr(m, name)) for name in (
            "fixed_s", "per_prompt_token_s", "attention_s", "per_sequence_s", "per_context_token_s")}
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump(doc, sort_keys=False)


def _round(value: float) -> float:
    return float(f"{value:.4g}")


def table_rows(result: ProfileResult) -> list[tuple[str, str, float, float]]:
    """(kind, point, measured s, fitted s) for every sample."""
    rows = [("prefill", f"{s.new_tokens} new + {s.cached_tokens} cached", s.seconds,
             result.prefill_model.seconds(s.new_tokens, s.cached_tokens)) for s in result.prefill_samples]
    if result.prefill_beside_decode_model is not None:
        model = result.prefill_beside_decode_model
        rows += [("prefill beside decode", f"{s.new_tokens} new + {s.cached_tokens} cached", s.seconds,
                  model.seconds(s.new_tokens, s.cached_tokens)) for s in result.prefill_beside_decode_samples]
    rows += [("decode step", f"batch {s.batch_size}, {s.context_tokens} context", s.seconds,
              result.decode_model.step_seconds(s.batch_size, s.context_tokens)) for s in result.decode_samples]
    if result.mixed_model is not None:
        rows += [("mixed step", f"{s.prompt_tokens}-token chunk, batch {s.batch_size}, {s.context_tokens} context", s.seconds,
                  result.mixed_model.seconds(s.prompt_tokens, s.attention_pairs, s.batch_size, s.context_tokens))
                 for s in result.mixed_samples]
    return rows


def fit_error(rows: Sequence[tuple[str, str, float, float]]) -> float:
    """Largest relative difference between measured and fitted times."""
    return max(abs(fitted - measured) / measured for _, _, measured, fitted in rows)
