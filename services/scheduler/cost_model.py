"""Cost models: prefill time, decode step time, KV transfer time — and fitting them to samples.

``crescent profile`` measures the engine and feeds ``fit_prefill_model`` / ``fit_decode_model``;
the paper preset (``cost_presets.py``) derives the same models from a FLOP count and an MFU.
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


class FitError(ValueError):
    """The samples cannot determine the model (too few, or no variation)."""


def _nonnegative_lstsq(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with coefficients ≥ 0: refit without any coefficient that came out negative."""
    active = list(range(features.shape[1]))
    coef = np.zeros(features.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(features[:, active], target, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        del active[int(np.argmin(sol))]
    return coef


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
