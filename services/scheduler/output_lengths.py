"""How long decode requests really run, calibrated from the ones that finished.

Decode reserves prompt + ``max_tokens`` of KV for a request's whole life and frees it when the
request ends; so *when* its KV frees depends on how many tokens it really generates, which is
often far fewer than ``max_tokens`` (a chat reply stops at its end-of-turn token). Predicting
every request to run its full ``max_tokens`` made the scheduler refuse batches as
``decode_kv_full`` with waits longer than the whole batch really took (issue 31, finding 8).

The gateway reports each request that finished at decode with the tokens it generated
(``RequestOutcome.finished``). Per model, the last ``window`` ratios output / ``max_tokens`` are
kept, and a request is expected to run ``max_tokens`` times their ``quantile`` (the 90th
percentile by default: most requests end sooner, so a wait predicted this way is rarely
late). Until ``min_samples`` requests finished, the ratio is 1: every request runs to
``max_tokens``, the cautious figure the scheduler used before it had observed anything.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class OutputLengths:
    window: int = 256
    min_samples: int = 8
    quantile: float = 0.9
    _ratios: dict[str, deque[float]] = field(default_factory=dict)
    _cached: dict[str, float] = field(default_factory=dict)  # model id -> ratio, until its next sample

    def observe(self, model_id: str, output_tokens: int, max_tokens: int) -> None:
        """A request of ``model_id`` finished after ``output_tokens`` of its ``max_tokens``."""
        if output_tokens <= 0 or max_tokens <= 0:
            return
        ratios = self._ratios.get(model_id)
        if ratios is None:
            ratios = self._ratios[model_id] = deque(maxlen=self.window)
        ratios.append(min(output_tokens / max_tokens, 1.0))
        self._cached.pop(model_id, None)

    def models(self) -> list[str]:
        return list(self._ratios)

    def samples(self, model_id: str) -> int:
        return len(self._ratios.get(model_id, ()))

    def ratio(self, model_id: str) -> float:
        """The share of ``max_tokens`` a request of ``model_id`` is expected to run (0 < r <= 1)."""
        cached = self._cached.get(model_id)
        if cached is not None:
            return cached
        ratios = self._ratios.get(model_id)
        if ratios is None or len(ratios) < self.min_samples:
            return 1.0
        ordered = sorted(ratios)
        ratio = ordered[min(math.ceil(self.quantile * len(ordered)) - 1, len(ordered) - 1)]
        self._cached[model_id] = ratio
        return ratio

    def expected_steps(self, model_id: str, max_tokens: int) -> float:
        """Decode steps a request of ``max_tokens`` is expected to run (at least one)."""
        return max(max_tokens * self.ratio(model_id), 1.0)
