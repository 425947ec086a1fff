"""What the gateway asks of the serving backend, independent of how it is reached.

``Backend.generate`` yields the first token (with the prompt's token counts), then batches of
further tokens; the last event carries the finish reason. A backend that loses an instance
mid-request moves the request elsewhere without the caller noticing (``migration``). Closing the iterator early (client
gone, stop string found) must abort the request everywhere it holds resources. Errors are
``crescent.services.gateway.errors.ApiError`` subclasses, so they map straight to HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Literal, NewType, Protocol

from crescent.protos.common_pb2 import Constraint

RequestId = NewType("RequestId", str)
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int                      # 0: off
    seed: int | None
    max_tokens: int                 # the first token included
    stop_token_ids: tuple[int, ...]  # with ignore_eos, what services/contract/finish.py is given
    ignore_eos: bool = False        # benchmarks: run to max_tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    constraint: Constraint | None = None  # structured output (services/model/grammar.py checked it)
    logprobs: int | None = None     # report each token's log-probability with this many alternatives; None: off


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: RequestId
    model_id: str
    prompt_token_ids: tuple[int, ...]
    cache_salt: bytes
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's raw log-probability and the most likely alternatives (docs/logprobs.md)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


@dataclass(frozen=True, slots=True)
class FirstToken:
    token_id: int
    prompt_tokens: int
    cached_tokens: int              # prompt tokens whose KV was reused
    finish_reason: FinishReason | None
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


@dataclass(frozen=True, slots=True)
class MoreTokens:
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when the request asked for logprobs


BackendEvent = FirstToken | MoreTokens


@dataclass(frozen=True, slots=True)
class BackendHealth:
    prefill_instances: int
    decode_instances: int

    @property
    def ready(self) -> bool:
        return self.prefill_instances > 0 and self.decode_instances > 0


class Backend(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncGenerator[BackendEvent, None]:
        """Place, prefill and decode one request; see the module docstring."""
        ...

    def generate_choices(self, request: GenerationRequest, n: int) -> list[AsyncGenerator[BackendEvent, None]]:
        """The events of each of ``n`` choices of ``request`` (``choices``), as ``generate`` gives one's.
        Every one must be closed, read or not: they may share one placement."""
        ...

    async def health(self) -> BackendHealth:
        """Instances registered with the scheduler; raises ServiceUnavailableError when it is unreachable."""
        ...

    async def close(self) -> None: ...
