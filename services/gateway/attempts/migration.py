"""Request migration: a request whose placement fails is placed again, and the client sees one stream.

- Prefill fails before the first token: the same request is placed again (the scheduler drops a
  dead instance within its heartbeat timeout, so a few retries with a short backoff get past it).
- The stream breaks after the first token (decode died or drained, prefill failed before its
  handoff): the request is placed again with the prompt plus every token generated so far as
  its prompt, ``first_step`` = the tokens the client has, ``max_tokens`` = what remains. The new
  prefill's first token is the next token of the stream, so it is passed on as ``MoreTokens``:
  no token is lost or repeated, and at temperature 0 the output equals an uninterrupted run.
  Its log-probabilities (when asked) travel with it, so the client's entries continue too.

Each attempt gets its own backend request id (decode keeps a tombstone for an aborted id, so an
id is never reused). Only when the retries or the deadline run out does the request fail.

An attempt that failed on an instance it could not reach names it, and the next placement
reports it to the scheduler (``AttemptRequest.unreachable``), which leaves it out until it
heartbeats again: a decode killed under N streams costs N re-placements, one per stream, and
none of them lands on the dead instance (``crescent_gateway_migrations_total`` counts each).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from functools import cache

from crescent.protos import common_pb2
from crescent.services.gateway.attempts.attempt import AttemptFailed, AttemptRequest, PlaceFailed
from crescent.services.gateway.backend import BackendEvent, FirstToken, GenerationRequest, MoreTokens, RequestId
from crescent.services.gateway.errors import GatewayTimeoutError, RateLimitedError, ServiceUnavailableError
from prometheus_client import Counter

log = logging.getLogger(__name__)

StartAttempt = Callable[[AttemptRequest], AsyncGenerator[BackendEvent, None]]


@dataclass(frozen=True, slots=True)
class MigrationPolicy:
    max_retries: int = 20         # consecutive failed attempts (no new token in between): ~33 s
    first_backoff_s: float = 0.1  # doubles per consecutive failure
    max_backoff_s: float = 2.0

    def backoff_s(self, failures: int) -> float:
        return min(self.first_backoff_s * 2 ** (failures - 1), self.max_backoff_s)


@cache
def migrations_counter() -> Counter:
    # Kept with the gateway's code rather than in services/common/metrics.py (shared by all services).
    counter = Counter("crescent_gateway_migrations", "Requests placed again after their placement failed", ["stage"])
    for stage in ("before_first_token", "mid_stream"):
        counter.labels(stage=stage)  # exported as 0 from the start, so rates and alerts see the series
    return counter


def attempt_request(request: GenerationRequest, generated: list[int], attempt: int, n: int = 1,
                    unreachable: tuple[str, ...] = ()) -> AttemptRequest:
    """The request to place for ``attempt`` (0: the original) once ``generated`` tokens were streamed;
    ``n``: the choices one placement serves (``choice_group``); ``unreachable``: the instances the
    previous attempt could not reach."""
    s = request.sampling
    attempt_id = request.request_id if attempt == 0 else RequestId(f"{request.request_id}-m{attempt}")
    return AttemptRequest(
        attempt_id=attempt_id,
        model_id=request.model_id,
        token_ids=request.prompt_token_ids + tuple(generated),
        cache_salt=request.cache_salt,
        sampling=common_pb2.SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            has_seed=s.seed is not None, seed=s.seed or 0,
            max_tokens=s.max_tokens - len(generated), stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos, first_step=len(generated),
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty, logit_bias=dict(s.logit_bias), min_tokens=s.min_tokens,
            constraint=s.constraint, logprobs=s.logprobs is not None, top_logprobs=s.logprobs or 0,
            n=n if n > 1 else 0,
        ),
        unreachable=unreachable,
    )


async def generate_with_migration(
    request: GenerationRequest,
    start: StartAttempt,
    *,
    deadline: float,
    clock: Callable[[], float],
    policy: MigrationPolicy = MigrationPolicy(),
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> AsyncGenerator[BackendEvent, None]:
    """The request's events as one uninterrupted stream, placing it again after each failure."""
    generated: list[int] = []
    attempt = 0
    failures = 0
    unreachable: tuple[str, ...] = ()  # what the last failure could not reach
    while True:
        try:
            async with aclosing(start(attempt_request(request, generated, attempt, unreachable=unreachable))) as events:
                async for event in events:
                    if isinstance(event, FirstToken):
                        failures = 0
                        if generated:  # a migrated attempt: its first token continues the stream
                            event = MoreTokens(token_ids=(event.token_id,), finish_reason=event.finish_reason,
                                               logprobs=(event.logprob,) if event.logprob is not None else ())
                            generated.append(event.token_ids[0])
                        else:
                            generated.append(event.token_id)
                    else:
                        generated.extend(event.token_ids)
                    yield event
                    if event.finish_reason is not None:
                        return
            raise AttemptFailed("backend", "the attempt ended without a finish reason",
                                before_first_token=not generated)
        except PlaceFailed as refused:
            # The first placement's refusal is the client's answer. A request already accepted
            # waits out a busy cluster or a role with no live instance (a supervisor is
            # restarting it) within its retries; a refusal no wait can fix ends it.
            if attempt == 0 or not isinstance(refused.error, RateLimitedError | ServiceUnavailableError):
                raise refused.error from None
            why = refused.error.message
            unreachable = ()
        except AttemptFailed as failed:
            why = str(failed)
            unreachable = (failed.unreachable,) if failed.unreachable else ()
        failures += 1
        attempt += 1
        stage = "before_first_token" if not generated else "mid_stream"
        # The client hears what happened; the last failure's detail (addresses, gRPC text) is logged.
        if failures > policy.max_retries:
            log.warning("giving up on %s after %d placements in a row; last: %s", request.request_id, failures, why)
            raise ServiceUnavailableError(
                f"the request failed on {failures} placements in a row; retry later", retry_after_s=1.0
            )
        pause = policy.backoff_s(failures)
        if clock() + pause >= deadline:
            log.warning("deadline of %s passed while placing it again; last: %s", request.request_id, why)
            raise GatewayTimeoutError("the request's deadline passed while placing it again")
        log.warning("placing %s again (%s, %d tokens streamed, retry %d) after: %s",
                    request.request_id, stage, len(generated), failures, why)
        migrations_counter().labels(stage=stage).inc()
        await sleep(pause)
