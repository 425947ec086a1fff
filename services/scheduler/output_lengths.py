"""How long decode requests really run, calibrated from the ones that finished.

Decode reserves prompt + ``max_tokens`` of KV for a request's whole life and frees it when the
request ends; so *when* its KV frees depends on how many tokens it really generates, which is
often far fewer than ``max_tokens`` (a chat reply stops at its end-of-turn token). Predicting
every request to run its whole ``max_tokens`` made the scheduler refuse batches as
``decode_kv_full`` with waits longer than the whole batch really took (issue 31, finding 8).

The gateway reports each request that finished at decode with the tokens it generated
(``RequestOutcome.finished``). One that generated fewer than its ``max_tokens`` stopped by
itself: its natural length is known. One that reached ``max_tokens`` was cut off: its natural
length is at least that (a *censored* observation: a ``max_tokens: 2`` health probe says
nothing about how long a 1,024-token request runs). Per model, over the last ``window``
observations, the Kaplan-Meier estimate of the natural length's distribution gives its
``quantile`` (the 90th percentile by default: most requests stop sooner, so a wait predicted
from it is rarely late), and a request is expected to run ``min(max_tokens, that length)``
steps. Until ``min_samples`` requests finished, or while too many were cut off for the
quantile to be known, it is ``max_tokens``: the cautious figure used before anything was seen.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


def natural_length_quantile(observations: list[tuple[int, bool]], quantile: float) -> float:
    """The ``quantile`` of natural output lengths from (tokens, stopped by itself) pairs, by the
    Kaplan-Meier estimator; ``inf`` when the cut-off requests leave it unknown."""
    ordered = sorted(observations, key=lambda o: (o[0], not o[1]))  # at equal lengths, stops first
    at_risk = len(ordered)
    survival = 1.0
    i = 0
    while i < len(ordered):
        tokens = ordered[i][0]
        stopped = cut = 0
        while i < len(ordered) and ordered[i][0] == tokens:
            if ordered[i][1]:
                stopped += 1
            else:
                cut += 1
            i += 1
        if stopped:
            survival *= 1.0 - stopped / at_risk
            if survival <= 1.0 - quantile + 1e-12:
                return float(tokens)
        at_risk -= stopped + cut
    return math.inf


@dataclass(slots=True)
class OutputLengths:
    window: int = 256
    min_samples: int = 8
    quantile: float = 0.9
    _seen: dict[str, deque[tuple[int, bool]]] = field(default_factory=dict)
    _cached: dict[str, float] = field(default_factory=dict)  # model id -> length, until its next observation

    def observe(self, model_id: str, output_tokens: int, max_tokens: int) -> None:
        """A request of ``model_id`` finished at decode after ``output_tokens`` of its ``max_tokens``."""
        if output_tokens <= 0 or max_tokens <= 0:
            return
        seen = self._seen.get(model_id)
        if seen is None:
            seen = self._seen[model_id] = deque(maxlen=self.window)
        seen.append((min(output_tokens, max_tokens), output_tokens < max_tokens))
        self._cached.pop(model_id, None)

    def models(self) -> list[str]:
        return list(self._seen)

    def samples(self, model_id: str) -> int:
        return len(self._seen.get(model_id, ()))

    def length(self, model_id: str) -> float:
        """The natural output length (tokens) few requests of ``model_id`` exceed; ``inf``: not known yet."""
        cached = self._cached.get(model_id)
        if cached is not None:
            return cached
        seen = self._seen.get(model_id)
        if seen is None or len(seen) < self.min_samples:
            return math.inf
        length = self._cached[model_id] = natural_length_quantile(list(seen), self.quantile)
        return length

    def expected_steps(self, model_id: str, max_tokens: int) -> float:
        """Decode steps a request of ``max_tokens`` is expected to run (at least one)."""
        return max(min(float(max_tokens), self.length(model_id)), 1.0)
