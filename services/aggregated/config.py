"""Settings of an aggregated instance (env prefix ``CRESCENT_AGGREGATED``): a prefill's (its
kvstore included), plus decode's stream timeout and how many prompt tokens each step mixes in."""

from __future__ import annotations

from pydantic import Field

from crescent.services.contract.mixed_steps import AGGREGATED_CHUNK_TOKENS
from crescent.services.prefill.config import PrefillBaseSettings

ENV_PREFIX = "CRESCENT_AGGREGATED"


class AggregatedSettings(PrefillBaseSettings):
    unclaimed_timeout_s: float = Field(
        default=10.0, gt=0, description="abort a request whose stream nobody opens within this time"
    )
    chunk_tokens: int = Field(
        default=AGGREGATED_CHUNK_TOKENS, ge=1,
        description="prompt tokens mixed into one decode step (chunked prefill; rounded down to whole KV blocks): "
                    "larger prefills faster, smaller keeps the gaps between decoded tokens short",
    )
