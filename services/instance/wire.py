"""Conversions between what travels between services (protobuf messages, KV blocks) and the engine's own types."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from crescent.protos import common_pb2
from crescent.services.contract.block_keys import BlockKey
from crescent.services.kvwire.kv_block import BlockFormatError, KvBlock
from crescent.services.engine.engine import Engine
from crescent.services.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from crescent.services.engine.sampler import SamplingConfig


def sampling_config(params: common_pb2.SamplingParams, stop_token_ids: Sequence[int] = ()) -> SamplingConfig:
    """The engine's view of a request's sampling; ``stop_token_ids`` are what ``min_tokens`` holds back."""
    return SamplingConfig(
        temperature=params.temperature,
        top_p=params.top_p if 0 < params.top_p <= 1 else 1.0,
        top_k=max(params.top_k, 0),
        seed=params.seed if params.has_seed else None,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty > 0 else 1.0,
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in params.logit_bias.items())),
        min_tokens=max(params.min_tokens, 0),  # counted against the step, which includes first_step
        stop_token_ids=tuple(sorted(stop_token_ids)),
        logprobs=min(max(params.top_logprobs, 0), MAX_TOP_LOGPROBS) if params.logprobs else None,
    )


def logprob_message(entry: TokenLogprob) -> common_pb2.TokenLogprob:
    """A sampled token's log-probabilities as they travel to the gateway."""
    return common_pb2.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob,
                                   top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top])


def kv_dtype(cache) -> str:
    """The dtype KV blocks of ``cache`` travel in, whatever the hop, by name ("float32",
    "bfloat16"): its ``wire_dtype`` — the cache's own, so nothing widens on the wire. An engine
    registers it (``kv_dtype``), and blocks and handoffs of another dtype are refused."""
    return str(cache.wire_dtype).removeprefix("torch.")


def payload_bytes(payload: torch.Tensor) -> bytes:
    """A block payload's raw little-endian bytes (numpy has no bfloat16: read them as bytes); a
    device payload (engine.device cuda) is copied to the host first."""
    return payload.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


# The dtypes a cache may keep KV in, by the name blocks carry (``kv_dtype``).
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def block_tensor(block: KvBlock, shape: tuple[int, ...]) -> torch.Tensor:
    """A received block's payload as a tensor of ``shape`` and its dtype, without copying it."""
    dtype = _TORCH_DTYPES.get(block.dtype)
    if dtype is None:
        raise BlockFormatError(f"KV block of dtype {block.dtype!r}: an engine's cache holds {', '.join(_TORCH_DTYPES)}")
    with warnings.catch_warnings():  # read-only buffers are fine: the engine copies them into its pool
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(block.payload, dtype=dtype).view(shape)


def block_matches(block: KvBlock, key: BlockKey | None, tokens: Sequence[int], cache) -> bool:
    """Whether a fetched block is the one this prompt needs here (key, tokens, the cache's dtype,
    and a full block of ``cache``'s layout: for a hybrid model, with or without a state snapshot)."""
    if block.key != key or list(block.token_ids) != list(tokens) or block.dtype != kv_dtype(cache):
        return False
    try:
        return cache.payload_tokens(tuple(block.shape)) == cache.block_size
    except ValueError:
        return False


def page_block(engine: Engine, page: int, key: BlockKey, parent: BlockKey | None, tokens: Sequence[int]) -> KvBlock:
    """A copy of one full cached page as a ``KvBlock`` (call on the engine thread)."""
    payload = engine.cache.read_block(page)  # a hybrid model's block carries its snapshot if it has one
    return KvBlock.build(key, parent, engine.model_id, kv_dtype(engine.cache), tuple(payload.shape), tokens,
                         payload_bytes(payload))
