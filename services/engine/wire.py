"""Conversions between protobuf messages and the engine's own types."""

from __future__ import annotations

from crescent.protos import common_pb2
from crescent.services.engine.sampler import SamplingConfig


def sampling_config(params: common_pb2.SamplingParams) -> SamplingConfig:
    return SamplingConfig(
        temperature=params.temperature,
        top_p=params.top_p if 0 < params.top_p <= 1 else 1.0,
        top_k=max(params.top_k, 0),
        seed=params.seed if params.has_seed else None,
    )
