"""What a request costs: a per-model price table with separate cache-hit input, cache-miss input
and output prices, in US dollars per million tokens (Kimi K3's published prices by default).

The usage ledger prices each request with it and the spend budget of a key or tenant counts it.
Prices are ``Decimal``: sums over many requests must not drift. Reasoning tokens are completion
tokens and cost the output price.
"""

from __future__ import annotations

from decimal import Decimal

from pydantic import Field

from crescent.services.common.settings import StrictModel

PER = Decimal(1_000_000)
ANY_MODEL = "*"  # the price table's entry for models it does not name


class ModelPrices(StrictModel):
    """US dollars per million tokens."""

    cache_hit_input: Decimal = Field(default=Decimal("0.30"), ge=0, description="prompt tokens served from the KV cache")
    cache_miss_input: Decimal = Field(default=Decimal("3.00"), ge=0, description="prompt tokens computed")
    output: Decimal = Field(default=Decimal("15.00"), ge=0, description="completion tokens, reasoning included")

    def price(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Decimal:
        cached = min(max(cached_tokens, 0), max(prompt_tokens, 0))
        return (cached * self.cache_hit_input + (prompt_tokens - cached) * self.cache_miss_input
                + completion_tokens * self.output) / PER

    def savings(self, cached_tokens: int) -> Decimal:
        """What the cache hits saved against computing those tokens."""
        return max(cached_tokens, 0) * (self.cache_miss_input - self.cache_hit_input) / PER


class PriceTable(StrictModel):
    """Prices by served model name; ``"*"`` for the rest."""

    models: dict[str, ModelPrices] = Field(default_factory=lambda: {ANY_MODEL: ModelPrices()})

    def for_model(self, model: str) -> ModelPrices:
        return self.models.get(model) or self.models.get(ANY_MODEL) or ModelPrices()
