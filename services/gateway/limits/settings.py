"""The gateway's ``limits`` settings: where the counters live, default limits, token weights.

Part of ``GatewaySettings`` (``limits:`` in the YAML file, ``CRESCENT_GATEWAY__LIMITS__*``);
docs/limits.md explains each.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Literal

from crescent.services.common.settings import StrictModel
from pydantic import Field, field_validator

_STORE_SCHEMES = ("redis://", "rediss://", "unix://")


class LimitValues(StrictModel):
    """Limits of every key, or of every tenant, that has none of its own (unset: no limit)."""

    rpm: int | None = Field(default=None, ge=1, description="requests per minute")
    tpm: int | None = Field(
        default=None, ge=1,
        description="tokens per minute, weighted by limits.token_weights; a request reserves its prompt "
                    "plus max_tokens (times n) when admitted and is charged its actual tokens when it ends",
    )
    max_concurrent: int | None = Field(default=None, ge=1, description="requests in flight at once")
    budget_usd: Decimal | None = Field(
        default=None, ge=0,
        description="US dollars per calendar month (UTC) at the prices of `prices`; once spent, requests "
                    "get 429 insufficient_quota until the month ends",
    )


class TokenWeights(StrictModel):
    """What one token counts for against a tokens-per-minute limit."""

    prompt: float = Field(default=1.0, ge=0, description="a prompt token computed (a prefix-cache miss)")
    cached: float = Field(default=1.0, ge=0, description="a prompt token served from the KV cache")
    completion: float = Field(default=1.0, ge=0, description="a generated token (reasoning included)")


class LimitSettings(StrictModel):
    """Rate limits and spend budgets per API key and per tenant (docs/limits.md)."""

    store: str = Field(
        default="memory", min_length=1,
        description="where the counters live: \"memory\" (this gateway alone) or a Redis URL "
                    "(redis://host:6379/0, rediss://…, unix://…) shared by every gateway replica",
    )
    key: LimitValues = Field(default_factory=LimitValues,
                             description="limits of a key that has none of its own")
    tenant: LimitValues = Field(default_factory=LimitValues,
                                description="limits of a tenant that has none of its own (with auth off: the one "
                                            "default tenant's)")
    token_weights: TokenWeights = Field(default_factory=TokenWeights)
    on_store_error: Literal["open", "closed"] = Field(
        default="open",
        description="when the store cannot be reached: \"open\" serves requests without limits (logged as "
                    "an error, counted in crescent_gateway_limit_store_errors_total), \"closed\" answers "
                    "503 rate_limit_store_unavailable",
    )
    store_timeout_s: float = Field(default=0.25, gt=0, le=10, description="deadline of one call to the store")
    lease_s: float = Field(
        default=30.0, gt=0, le=3600,
        description="a request's concurrency slot lasts this long unless its gateway renews it (every third "
                    "of it): the slots of a gateway that dies come back within this time",
    )
    period_s: float = Field(
        default=60.0, gt=0, le=3600,
        description="the period rpm and tpm count over: 60 s, as their names say (tests shorten it)",
    )
    key_prefix: str = Field(default="crescent:limits:", description="prefix of every Redis key the limits use")

    @field_validator("store")
    @classmethod
    def _known_store(cls, value: str) -> str:
        if value != "memory" and not value.startswith(_STORE_SCHEMES):
            raise ValueError(f"limits.store must be \"memory\" or a Redis URL ({', '.join(_STORE_SCHEMES)}), "
                             f"not {value!r}")
        return value
