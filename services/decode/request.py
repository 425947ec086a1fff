"""What a decode instance holds per request: its choices (sequences) and the updates it streams.

A request is what one ``Handoff`` brought and one ``StreamTokens`` call reads. It has one
``Choice`` per sequence it decodes: one, or with ``n > 1`` one per choice still generating, all
on the prompt's KV (full pages shared, the last partial page copied per choice; see
``Engine.fork_sequence``). Updates of every choice go into the request's one queue, tagged
with the choice's index; the update that ends its last choice is marked ``last``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from crescent.services.engine.constraints import TokenConstraint
from crescent.services.engine.engine import Sequence
from crescent.services.engine.logprobs import TokenLogprob
from crescent.services.engine.sampler import SamplingConfig

# How a request ended when it did not finish normally; StreamTokens turns these into gRPC errors.
ERROR = "error"          # its own step failed
DRAINING = "draining"    # the instance shut down before it finished (the gateway migrates it)
ABORTED = "aborted"      # the gateway asked (Abort) or nobody streamed it
ENDINGS = (ERROR, DRAINING, ABORTED)


@dataclass(frozen=True, slots=True)
class TokenUpdate:
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop", "length", one of the ENDINGS, or None while running
    detail: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when the request asked for them
    index: int = 0             # the choice it belongs to
    last: bool = False         # nothing follows: every choice has ended

    @property
    def ends_request(self) -> bool:
        return self.last or self.finish_reason in ENDINGS


@dataclass(slots=True, eq=False)  # compared by identity: it holds a sequence
class Choice:
    """One sequence a request decodes."""

    index: int
    token_ids: list[int]              # prompt + its first token (sampled by prefill)
    sampling: SamplingConfig          # n > 1: with the choice's own seed
    constraint: TokenConstraint | None = None  # structured output: its matcher has taken every token so far
    generated: int = 1                # the first token came from prefill
    seq: Sequence | None = None       # set once admitted
    finished: bool = False


@dataclass(slots=True, eq=False)  # compared by identity: it holds tensors and a queue
class DecodeRequest:
    request_id: str
    choices: list[Choice]             # the choices still to decode (prefill may have ended some)
    payloads: list[torch.Tensor] | None  # the prompt's KV while it waits; None once in the cache
    max_tokens: int                   # tokens to generate per choice, the first one (prefill's) included
    stop_token_ids: frozenset[int]
    reserve_tokens: int               # KV tokens a choice may ever hold: prompt + max_tokens, within the context
    first_step: int = 0               # seeded sampling step of the first token (after a migration)
    queue: asyncio.Queue[TokenUpdate] = field(default_factory=asyncio.Queue)
    claimed: bool = False
    received_at: float = field(default_factory=time.monotonic)
    finished: bool = False
    # Aggregated instances: the prompt's KV is this sequence's, prefilled here (no payloads);
    # the choices fork it, and ``adopted`` is set once they hold their pages.
    local_prompt: Sequence | None = None
    adopted: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def prompt_tokens(self) -> int:
        return len(self.choices[0].token_ids) - 1

    @property
    def open_choices(self) -> list[Choice]:
        return [c for c in self.choices if not c.finished]

    def choice(self, index: int) -> Choice | None:
        return next((c for c in self.choices if c.index == index), None)
