"""Cost models: prefill time, decode step time, mixed step time, KV transfer time — and fitting
them to samples.

``crescent profile`` measures the engine and feeds ``fit_prefill_model`` / ``fit_decode_model``
(the two pools) and ``fit_mixed_step_model`` (an aggregated engine's steps: prompt chunks and
decode rows in one forward); the paper preset (``cost_presets.py``) derives the prefill and
decode models from a FLOP count and an MFU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from crescent.services.scheduler.datatypes import Tier


@dataclass(frozen=True, slots=True)
class PrefillCostModel:
    """t(u, c) = fixed_s + per_token_s·u + attention_s·(u·c + u²/2) for u new tokens after c cached.

    The linear term is the weight FLOPs of each new token; the attention term counts the
    query-key pairs each new token sees (all cached tokens and the new ones before it).
    """

    fixed_s: float
    per_token_s: float
    attention_s: float

    def seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        u = float(new_tokens)
        return self.fixed_s + self.per_token_s * u + self.attention_s * (u * cached_tokens + u * u / 2)


@dataclass(frozen=True, slots=True)
class DecodeCostModel:
    """One decode step: fixed (weights read) + per sequence + per token of context (KV read)."""

    fixed_s: float
    per_sequence_s: float
    per_context_token_s: float

    def step_seconds(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        return self.fixed_s + self.per_sequence_s * batch_size + self.per_context_token_s * context_tokens


@dataclass(frozen=True, slots=True)
class MixedStepCostModel:
    """One forward of prompt chunks and decode rows together (``Engine.mixed_step``).

    t = fixed_s + per_prompt_token_s·Σu + attention_s·Σ(u·c + u²/2)
        + per_sequence_s·batch + per_context_token_s·context,
    over the chunks (u new tokens after c computed ones each) and the decoding batch (context:
    the batch's total context tokens). One fixed cost per step, however many rows share it:
    that is what mixing saves over a prefill forward plus a decode forward.
    """

    fixed_s: float
    per_prompt_token_s: float
    attention_s: float
    per_sequence_s: float
    per_context_token_s: float

    def step_seconds(self, chunks: Sequence[tuple[int, int]], batch_size: int = 0, context_tokens: int = 0) -> float:
        """``chunks``: (new tokens, tokens before them) per prompt in the step."""
        return self.seconds(sum(u for u, _ in chunks if u > 0), attention_pairs(chunks), batch_size, context_tokens)

    def seconds(self, prompt_tokens: int, pairs: float, batch_size: int, context_tokens: int) -> float:
        """A step of ``prompt_tokens`` chunk tokens seeing ``pairs`` query-key pairs, and decode rows."""
        if prompt_tokens <= 0 and batch_size <= 0:
            return 0.0
        return (self.fixed_s + self.per_prompt_token_s * prompt_tokens + self.attention_s * pairs
                + self.per_sequence_s * max(batch_size, 0) + self.per_context_token_s * context_tokens)

    def prefill_model(self) -> PrefillCostModel:
        """A step that is one prompt chunk alone."""
        return PrefillCostModel(self.fixed_s, self.per_prompt_token_s, self.attention_s)

    def decode_model(self) -> DecodeCostModel:
        """A step that is decode rows alone."""
        return DecodeCostModel(self.fixed_s, self.per_sequence_s, self.per_context_token_s)


@dataclass(frozen=True, slots=True)
class MixedPrefillCost:
    """A prompt's prefill on an aggregated instance: its chunks (``chunk_tokens`` each) ride
    mixed steps that also carry the instance's ``decode_batch`` decoding rows (``decode_context``
    tokens of context), so every chunk pays a step's fixed cost and those rows' share.

    ``seconds(u, c)`` as ``PrefillCostModel.seconds``: steps·(fixed + rows) + per token·u +
    attention·(u·c + u²/2) — the chunks' query-key pairs add up to the whole prompt's.
    """

    mixed: MixedStepCostModel
    chunk_tokens: int
    decode_batch: int = 0
    decode_context: int = 0

    def seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        m, u = self.mixed, float(new_tokens)
        steps = -(-new_tokens // max(self.chunk_tokens, 1))
        per_step = m.fixed_s + m.per_sequence_s * max(self.decode_batch, 0) + m.per_context_token_s * self.decode_context
        return steps * per_step + m.per_prompt_token_s * u + m.attention_s * (u * cached_tokens + u * u / 2)


def attention_pairs(chunks: Sequence[tuple[int, int]]) -> float:
    """Query-key pairs the chunks' new tokens see: Σ u·c + u²/2 (as ``PrefillCostModel``)."""
    return float(sum(u * c + u * u / 2 for u, c in chunks if u > 0))


@dataclass(frozen=True, slots=True)
class TransferCostModel:
    """Moving KV blocks from a source tier to an instance: latency + bytes / bandwidth."""

    kv_bytes_per_token: int
    latency_s: float
    bytes_per_s: Mapping[Tier, float]

    def seconds(self, tokens: int, tier: Tier = Tier.ENGINE) -> float:
        if tokens <= 0:
            return 0.0
        return self.latency_s + tokens * self.kv_bytes_per_token / self.bytes_per_s[tier]

    def seconds_per_token(self, tier: Tier) -> float:
        return self.kv_bytes_per_token / self.bytes_per_s[tier]

    def seconds_by_tier(self, tokens_per_tier: Mapping[Tier, int]) -> float:
        """Tiers are read one after another, with one latency for the whole pull."""
        total = sum(n * self.kv_bytes_per_token / self.bytes_per_s[t] for t, n in tokens_per_tier.items() if n > 0)
        return self.latency_s + total if total else 0.0


@dataclass(frozen=True, slots=True)
class CostModels:
    prefill: PrefillCostModel
    decode: DecodeCostModel
    transfer: TransferCostModel
    mixed: MixedStepCostModel | None = None  # an aggregated engine's steps, when profiled
    prefill_beside_decode: PrefillCostModel | None = None  # prefill while decode shares its cores, when profiled


@dataclass(frozen=True, slots=True)
class PrefillSample:
    new_tokens: int
    cached_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    batch_size: int
    context_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class MixedStepSample:
    prompt_tokens: int       # new prompt tokens over the step's chunks
    attention_pairs: float   # their Σ u·c + u²/2
    batch_size: int          # decode rows
    context_tokens: int      # the decode rows' total context
    seconds: float


class FitError(ValueError):
    """The samples cannot determine the model (too few, or no variation)."""


def _nonnegative_lstsq(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with coefficients ≥ 0 (non-negative least squares). With a handful of
    coefficients every subset of them can be tried: the best fit whose coefficients are all
    non-negative is the answer (a greedy drop of the most negative one can drop the wrong one)."""
    n = features.shape[1]
    best, best_residual = np.zeros(n), float(np.sum(target**2))
    for mask in range(1, 1 << n):
        active = [i for i in range(n) if mask >> i & 1]
        sol, *_ = np.linalg.lstsq(features[:, active], target, rcond=None)
        if (sol < 0).any():
            continue
        residual = float(np.sum((features[:, active] @ sol - target) ** 2))
        if residual < best_residual - 1e-18:
            best, best_residual = np.zeros(n), residual
            best[active] = sol
    return best


def fit_prefill_model(samples: Sequence[PrefillSample]) -> PrefillCostModel:
    """Fit ``PrefillCostModel`` to measured prefills (vary both prompt and cached length)."""
    if len(samples) < 3:
        raise FitError(f"need at least 3 prefill samples, got {len(samples)}")
    u = np.array([s.new_tokens for s in samples], dtype=float)
    c = np.array([s.cached_tokens for s in samples], dtype=float)
    if np.ptp(u) == 0:
        raise FitError("prefill samples must vary the number of new tokens")
    features = np.stack([np.ones_like(u), u, u * c + u * u / 2], axis=1)
    coef = _nonnegative_lstsq(features, np.array([s.seconds for s in samples], dtype=float))
    return PrefillCostModel(fixed_s=float(coef[0]), per_token_s=float(coef[1]), attention_s=float(coef[2]))


def fit_decode_model(samples: Sequence[DecodeSample]) -> DecodeCostModel:
    """Fit ``DecodeCostModel`` to measured decode steps (vary batch size and context)."""
    if len(samples) < 3:
        raise FitError(f"need at least 3 decode samples, got {len(samples)}")
    b = np.array([s.batch_size for s in samples], dtype=float)
    ctx = np.array([s.context_tokens for s in samples], dtype=float)
    if np.ptp(b) == 0 and np.ptp(ctx) == 0:
        raise FitError("decode samples must vary batch size or context length")
    features = np.stack([np.ones_like(b), b, ctx], axis=1)
    coef = _nonnegative_lstsq(features, np.array([s.seconds for s in samples], dtype=float))
    return DecodeCostModel(fixed_s=float(coef[0]), per_sequence_s=float(coef[1]), per_context_token_s=float(coef[2]))


def fit_mixed_step_model(samples: Sequence[MixedStepSample]) -> MixedStepCostModel:
    """Fit ``MixedStepCostModel`` to measured steps (vary chunk size, chunk context, batch and context)."""
    if len(samples) < 5:
        raise FitError(f"need at least 5 mixed-step samples, got {len(samples)}")
    columns = [[1.0] * len(samples), [s.prompt_tokens for s in samples], [s.attention_pairs for s in samples],
               [s.batch_size for s in samples], [s.context_tokens for s in samples]]
    features = np.array(columns, dtype=float).T
    if np.ptp(features[:, 1]) == 0 or np.ptp(features[:, 3]) == 0:
        raise FitError("mixed-step samples must vary both the prompt tokens and the decode batch")
    seconds = np.array([s.seconds for s in samples], dtype=float)
    if (seconds <= 0).any():
        raise FitError("mixed-step samples must have positive times")
    # Relative errors: a 30 ms decode step weighs as much as a 300 ms chunk, since an aggregated
    # engine runs many more of the former and each one delays every first token behind it.
    coef = _nonnegative_lstsq(features / seconds[:, None], np.ones_like(seconds))
    return MixedStepCostModel(*(float(c) for c in coef))


def fit_transfer_model(
    kv_bytes_per_token: int, samples_by_tier: Mapping[Tier, Sequence[tuple[int, float]]], latency_s: float = 0.0
) -> TransferCostModel:
    """Bandwidth per tier from (bytes, seconds) measurements: total bytes over total time."""
    rates: dict[Tier, float] = {}
    for tier, samples in samples_by_tier.items():
        moved = sum(n for n, _ in samples)
        spent = sum(max(t - latency_s, 1e-9) for _, t in samples)
        if moved <= 0:
            raise FitError(f"no bytes measured for tier {tier.name}")
        rates[tier] = moved / spent
    return TransferCostModel(kv_bytes_per_token=kv_bytes_per_token, latency_s=latency_s, bytes_per_s=rates)
