"""Per-request latency and usage accounting, reported to the gateway's Prometheus metrics.

TTFT is measured from the moment the request arrived to the first generated token; the
inter-token intervals are what a streaming client sees (tokens that arrive together count as
0 s apart); TBT is Mooncake's (``contract.latency.tbt_seconds``).

A request with ``n`` choices (docs/api.md, "n > 1") is one request here: TTFT is its first token
(choice 0's), intervals are measured within each choice, and its usage is what the client is
told (``choices_usage``): the prompt once, every choice's completion tokens.

A request with an ``account`` (``ledger.Account``) is priced and written to the usage ledger
when it finishes; ``committed`` waits for its row (handlers await it before a response's last
bytes). Reasoning tokens are the completion tokens generated up to the end of the reasoning
(``mark_reasoning``, told by the output parser), counted across choices; they are part of the
completion tokens, and the usage a client is told carries them (``UsageCounts.reasoning_tokens``,
OpenAI's ``completion_tokens_details.reasoning_tokens``), the same count the ledger row holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from crescent.services.common.metrics import GatewayMetrics
from crescent.services.contract.latency import tbt_seconds

log = logging.getLogger(__name__)

RequestStatus = Literal["ok", "client_error", "rejected", "error", "cancelled"]


@dataclass(frozen=True, slots=True)
class UsageCounts:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0  # of the completion tokens, those generated up to the end of the reasoning


def total_usage(usages: Sequence[UsageCounts]) -> UsageCounts:
    """Usage of separate prompts (``/v1/completions`` with a list): every prompt and completion counts."""
    return UsageCounts(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        reasoning_tokens=sum(u.reasoning_tokens for u in usages),
    )


def choices_usage(usages: Sequence[UsageCounts]) -> UsageCounts:
    """Usage of the choices of one prompt, choice 0 first: the prompt counts once, with the tokens
    choice 0 found cached (as OpenAI bills ``n``); every choice's completion tokens count."""
    return UsageCounts(
        prompt_tokens=usages[0].prompt_tokens,
        cached_tokens=usages[0].cached_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        reasoning_tokens=sum(u.reasoning_tokens for u in usages),
    )


def response_usage(usages: Sequence[UsageCounts], n: int) -> UsageCounts:
    """Usage of a response whose choices (in choice order) are ``n`` per prompt."""
    return total_usage([choices_usage(usages[i:i + n]) for i in range(0, len(usages), n)])


class UsageSink(Protocol):
    """Where a finished request's usage goes (``ledger.Account``)."""

    def settle(self, status: RequestStatus, usage: UsageCounts | None, reasoning_tokens: int,
               ttft_s: float | None) -> None: ...

    async def committed(self) -> None: ...


class RequestRecord:
    """Timing and outcome of one request, all its choices together; ``finish`` reports it once."""

    def __init__(self, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic, *,
                 account: UsageSink | None = None) -> None:
        self._metrics = metrics
        self._clock = clock
        self._account = account
        self._reasoning: dict[int, int] = {}  # by choice: completion tokens up to the end of its reasoning
        self._started = clock()
        self._first_token: float | None = None
        self._last_token: dict[int, float] = {}  # by choice
        self._intervals: list[float] = []
        self._finished = False
        self._usage: dict[int, UsageCounts] = {}  # by choice, kept current while tokens arrive
        metrics.in_flight.inc()

    @property
    def usage(self) -> UsageCounts | None:
        """The request's usage so far (``choices_usage`` of the choices that reported any)."""
        if not self._usage:
            return None
        return choices_usage([self.choice_usage(i) for i in sorted(self._usage)])

    def set_usage(self, usage: UsageCounts, choice: int = 0) -> UsageCounts:
        """Record the choice's usage so far; returns it with the choice's reasoning tokens
        (``choice_usage``), what a ``Finished`` event carries to the client."""
        self._usage[choice] = usage
        return self.choice_usage(choice)

    def choice_usage(self, choice: int = 0) -> UsageCounts:
        """The choice's usage so far, its reasoning tokens (``mark_reasoning``) included."""
        usage = self._usage.get(choice, UsageCounts(0, 0, 0))
        return replace(usage, reasoning_tokens=self._reasoning.get(choice, 0))

    def mark_reasoning(self, choice: int = 0) -> None:
        """The choice's tokens so far are reasoning (its output parser is still in, or just left, it)."""
        usage = self._usage.get(choice)
        self._reasoning[choice] = usage.completion_tokens if usage is not None else 0

    @property
    def reasoning_tokens(self) -> int:
        return sum(self._reasoning.values())

    def tokens_arrived(self, count: int, choice: int = 0) -> None:
        if count <= 0:
            return
        now = self._clock()
        if self._first_token is None:
            self._first_token = now
            self._metrics.ttft.observe(now - self._started)
        last = self._last_token.get(choice)
        if last is None:
            gaps = [0.0] * (count - 1)
        else:
            gaps = [now - last] + [0.0] * (count - 1)
        self._last_token[choice] = now
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
            f"{usage.prompt_tokens} prompt ({usage.cached_tokens} cached) + {usage.completion_tokens} completion "
            f"({usage.reasoning_tokens} reasoning) tokens"
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
        if self._last_token:
            tbt = tbt_seconds(self._intervals)
            if tbt is not None:
                m.tbt.observe(tbt)
        if self._account is not None:
            ttft_s = None if self._first_token is None else self._first_token - self._started
            self._account.settle(status, usage, self.reasoning_tokens, ttft_s)

    async def committed(self) -> None:
        """Return once the request's usage row is committed (at once without a durable ledger)."""
        if self._account is not None:
            await self._account.committed()

    @property
    def finished(self) -> bool:
        return self._finished
