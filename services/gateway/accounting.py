"""Per-request latency and usage accounting, reported to the gateway's Prometheus metrics.

TTFT is measured from the moment the request arrived to the first generated token; the
inter-token intervals are what a streaming client sees (tokens that arrive together count as
0 s apart); TBT is Mooncake's: the mean of the longest 10% of a request's intervals.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from crescent.services.common.metrics import GatewayMetrics

log = logging.getLogger(__name__)

RequestStatus = Literal["ok", "client_error", "rejected", "error", "cancelled"]


@dataclass(frozen=True, slots=True)
class UsageCounts:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def tbt_seconds(intervals: Sequence[float]) -> float | None:
    """Mean of the longest 10% of the intervals (at least one); None without intervals."""
    if not intervals:
        return None
    longest = sorted(intervals, reverse=True)[: max(1, math.ceil(len(intervals) * 0.1))]
    return sum(longest) / len(longest)


class RequestRecord:
    """Timing and outcome of one request; ``finish`` reports it once."""

    def __init__(self, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._clock = clock
        self._started = clock()
        self._first_token: float | None = None
        self._last_token: float | None = None
        self._intervals: list[float] = []
        self._finished = False
        self.usage: UsageCounts | None = None  # kept current while tokens arrive
        metrics.in_flight.inc()

    def tokens_arrived(self, count: int) -> None:
        if count <= 0:
            return
        now = self._clock()
        if self._last_token is None:
            self._first_token = now
            self._metrics.ttft.observe(now - self._started)
            gaps = [0.0] * (count - 1)
        else:
            gaps = [now - self._last_token] + [0.0] * (count - 1)
        self._last_token = now
        for gap in gaps:
            self._metrics.inter_token.observe(gap)
        self._intervals.extend(gaps)

    def finish(self, status: RequestStatus) -> None:
        if self._finished:
            return
        self._finished = True
        usage = self.usage
        ttft = "-" if self._first_token is None else f"{self._first_token - self._started:.3f} s"
        tokens = "no tokens" if usage is None else (
            f"{usage.prompt_tokens} prompt ({usage.cached_tokens} cached) + {usage.completion_tokens} completion tokens"
        )
        log.info("request %s in %.3f s: ttft %s, %s", status, self._clock() - self._started, ttft, tokens)
        m = self._metrics
        m.in_flight.dec()
        m.requests.labels(status=status).inc()
        if usage is not None:
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.cached_tokens.inc(usage.cached_tokens)
            m.completion_tokens.inc(usage.completion_tokens)
        if status == "ok":
            m.e2e.observe(self._clock() - self._started)
        if self._last_token is not None:
            tbt = tbt_seconds(self._intervals)
            if tbt is not None:
                m.tbt.observe(tbt)

    @property
    def finished(self) -> bool:
        return self._finished
