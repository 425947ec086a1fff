"""The requests a vLLM-backed instance holds, between its Prefill call and its token stream.

Each choice of a request runs as its own vLLM request (``<id>#<index>``, its seed derived as the
native engine derives it), so one choice can be ended alone. The choices after the first start
once the first has its first token: the prompt's full blocks are then in vLLM's prefix cache and
the others reuse them (the prompt's KV shared, as ``n`` is on the native engine).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from crescent.protos import common_pb2


@dataclass(frozen=True, slots=True)
class ChoiceUpdate:
    """What one vLLM output of a choice brought its stream (decode's ``TokenUpdate`` carries a
    native sequence's; these carry vLLM's tokens and logprobs as messages)."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[common_pb2.TokenLogprob, ...] = ()
    finish_reason: str | None = None   # "stop", "length", one of decode.request.ENDINGS, None while running
    detail: str = ""


@dataclass(frozen=True, slots=True)
class FirstTokens:
    """What the first vLLM output of a choice brought."""

    token_id: int
    logprob: common_pb2.TokenLogprob | None
    cached_tokens: int
    finish_reason: str | None   # set when the choice ended at its first token


@dataclass
class ChoiceState:
    index: int
    vllm_id: str
    first: asyncio.Future[FirstTokens]
    finished: bool = False
    task: asyncio.Task | None = None


@dataclass
class HeldRequest:
    request_id: str
    prompt_tokens: int
    reserve_tokens: int                   # KV it may hold: prompt + max_tokens per choice
    choices: list[ChoiceState] = field(default_factory=list)
    queue: asyncio.Queue[ChoiceUpdate] = field(default_factory=asyncio.Queue)
    awaiting: set[int] = field(default_factory=set)  # choices whose finish the reader has not seen
    claimed: bool = False
    handed_off: bool = False
    created: float = field(default_factory=time.monotonic)

    @property
    def open_choices(self) -> list[ChoiceState]:
        return [c for c in self.choices if not c.finished]

    def choice(self, index: int) -> ChoiceState | None:
        return self.choices[index] if 0 <= index < len(self.choices) else None
