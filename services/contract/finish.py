"""The one finish rule on the request path: when a request (or one of its choices) ends, and why.

The stop set is the ids the gateway asks for (``SamplingParams.stop_token_ids``) plus the
model's end-of-sequence ids unless ``ignore_eos``. A sampled token ends generation with
``stop`` when it is in that set, else with ``length`` once ``max_tokens`` are generated or the
context window is full. Prefill (the first token), decode (every later one) and the engine's
single-process ``generate`` all apply ``finish_reason``, so no two services can disagree about
when a request is finished. Stop *strings* are text and stay with the gateway, which owns the
tokenizer.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Literal

FinishReason = Literal["stop", "length"]


def stop_token_ids(requested: Iterable[int], eos_token_ids: Iterable[int], ignore_eos: bool) -> frozenset[int]:
    """The ids that end a request: those asked for, plus the model's EOS ids unless ignored."""
    stop = set(requested)
    if not ignore_eos:
        stop.update(eos_token_ids)
    return frozenset(stop)


def finish_reason(token: int, generated: int, max_tokens: int, stop_ids: Container[int], *,
                  context_tokens: int = 0, context_window: int = 0) -> FinishReason | None:
    """Why generation ends at ``token``, or None to go on.

    ``generated`` counts ``token`` itself; ``context_tokens`` is what the sequence holds once
    ``token`` is in it, checked against ``context_window`` when both are given (decode's case:
    prefill's first token always fits, since the gateway checked the prompt against the window).
    """
    if token in stop_ids:
        return "stop"
    if generated >= max_tokens or (context_window > 0 and context_tokens >= context_window):
        return "length"
    return None
