"""The migration loop without a network: scripted attempts stand in for placements."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from crescent.services.gateway.attempts.attempt import AttemptFailed, AttemptRequest, PlaceFailed
from crescent.services.gateway.backend import (
    BackendEvent,
    FirstToken,
    GenerationRequest,
    MoreTokens,
    RequestId,
    Sampling,
)
from crescent.services.gateway.errors import (
    GatewayTimeoutError,
    InvalidRequestError,
    RateLimitedError,
    ServiceUnavailableError,
)
from crescent.services.gateway.attempts.migration import MigrationPolicy, generate_with_migration

REQUEST = GenerationRequest(
    request_id=RequestId("r"), model_id="m", prompt_token_ids=(1, 2, 3), cache_salt=b"s",
    sampling=Sampling(temperature=0.0, top_p=1.0, top_k=0, seed=7, max_tokens=6, stop_token_ids=(99,)),
)
REPLY = [10, 11, 12, 13, 14, 15]  # what an uninterrupted run generates


class Script:
    """Each attempt serves REPLY from its first_step on; ``plans[n]`` says how attempt n ends:
    ("ok",), ("fail", tokens_before_failing[, unreachable instance]), ("refuse", error)."""

    def __init__(self, *plans: tuple[Any, ...]) -> None:
        self.plans = list(plans)
        self.seen: list[AttemptRequest] = []
        self.closed = 0

    async def attempt(self, request: AttemptRequest) -> AsyncGenerator[BackendEvent, None]:
        self.seen.append(request)
        plan = self.plans.pop(0) if self.plans else ("ok",)
        if plan[0] == "refuse":
            raise PlaceFailed(plan[1])
        step = request.sampling.first_step
        left = REPLY[step:]
        budget = len(left) if plan[0] == "ok" else plan[1]
        try:
            for i, token in enumerate(left[:budget]):
                last = step + i == len(REPLY) - 1
                reason = "length" if last else None
                if i == 0:
                    yield FirstToken(token, len(request.token_ids), 0, reason)
                else:
                    yield MoreTokens((token,), reason)
            if plan[0] == "fail":
                raise AttemptFailed("decode", "lost", before_first_token=budget == 0,
                                    unreachable=plan[2] if len(plan) > 2 else "")
        finally:
            self.closed += 1


async def run(script: Script, policy: MigrationPolicy = MigrationPolicy(), deadline: float = 1e9,
              limit: int | None = None) -> tuple[list[BackendEvent], list[float]]:
    pauses: list[float] = []

    async def sleep(s: float) -> None:
        pauses.append(s)

    events: list[BackendEvent] = []
    gen = generate_with_migration(REQUEST, script.attempt, deadline=deadline, clock=lambda: 0.0,
                                  policy=policy, sleep=sleep)
    async for event in gen:
        events.append(event)
        if limit is not None and len(events) == limit:
            await gen.aclose()
            break
    return events, pauses


def tokens(events: list[BackendEvent]) -> list[int]:
    out: list[int] = []
    for e in events:
        out.extend((e.token_id,) if isinstance(e, FirstToken) else e.token_ids)
    return out


def test_an_uninterrupted_run_is_one_attempt() -> None:
    script = Script(("ok",))
    events, pauses = asyncio.run(run(script))
    assert tokens(events) == REPLY and pauses == [] and len(script.seen) == 1
    assert script.seen[0].attempt_id == "r" and script.seen[0].sampling.first_step == 0


def test_migrations_continue_the_stream_exactly() -> None:
    script = Script(("fail", 2), ("fail", 0), ("fail", 3), ("ok",))
    events, pauses = asyncio.run(run(script))
    assert tokens(events) == REPLY
    assert isinstance(events[0], FirstToken)
    assert all(isinstance(e, MoreTokens) for e in events[1:])  # a later first token continues the stream
    assert events[-1].finish_reason == "length"
    seen = [(r.attempt_id, r.token_ids, r.sampling.first_step, r.sampling.max_tokens) for r in script.seen]
    assert seen == [
        ("r", (1, 2, 3), 0, 6),
        ("r-m1", (1, 2, 3, 10, 11), 2, 4),
        ("r-m2", (1, 2, 3, 10, 11), 2, 4),
        ("r-m3", (1, 2, 3, 10, 11, 12, 13, 14), 5, 1),
    ]
    assert all(r.sampling.seed == 7 and list(r.sampling.stop_token_ids) == [99] for r in script.seen)
    # The backoff doubles while no token arrives, and starts over after progress.
    assert pauses == [0.1, 0.2, 0.1]


def test_retries_run_out() -> None:
    script = Script(*[("fail", 0)] * 10)
    with pytest.raises(ServiceUnavailableError, match="3 placements in a row"):
        asyncio.run(run(script, MigrationPolicy(max_retries=2)))
    assert len(script.seen) == 3 and script.closed == 3


def test_the_deadline_stops_retries() -> None:
    script = Script(*[("fail", 0)] * 10)
    with pytest.raises(GatewayTimeoutError):
        asyncio.run(run(script, deadline=0.05))
    assert len(script.seen) == 1


def test_a_migrated_request_waits_for_a_role_to_come_back() -> None:
    # Its only decode instance died: the scheduler says none is registered until it restarts.
    gone = ServiceUnavailableError("rejected by the scheduler (no_decode_instance)", retry_after_s=2)
    script = Script(("fail", 2), ("refuse", gone), ("refuse", gone), ("ok",))
    events, pauses = asyncio.run(run(script))
    assert tokens(events) == REPLY and pauses == [0.1, 0.2, 0.4]


def test_a_migrated_request_fails_on_a_refusal_no_wait_can_fix() -> None:
    script = Script(("fail", 2), ("refuse", InvalidRequestError("exceeds_kv_capacity")))
    with pytest.raises(InvalidRequestError):
        asyncio.run(run(script))


def test_the_first_placement_refusal_is_the_answer() -> None:
    refusal = RateLimitedError("ttft_slo", retry_after_s=3)
    with pytest.raises(RateLimitedError, match="ttft_slo"):
        asyncio.run(run(Script(("refuse", refusal))))


def test_a_refused_re_placement_is_retried_unless_the_request_is_at_fault() -> None:
    busy = ServiceUnavailableError("no_prefill_instance", retry_after_s=1)
    events, _ = asyncio.run(run(Script(("fail", 1), ("refuse", busy), ("ok",))))
    assert tokens(events) == REPLY
    with pytest.raises(InvalidRequestError):
        asyncio.run(run(Script(("fail", 1), ("refuse", InvalidRequestError("bad")))))


def test_closing_the_stream_closes_the_attempt() -> None:
    script = Script(("ok",))
    events, _ = asyncio.run(run(script, limit=2))
    assert tokens(events) == REPLY[:2] and script.closed == 1


def test_the_instance_a_failure_could_not_reach_is_reported_with_the_next_placement_only() -> None:
    # decode-1 died mid-stream: the re-placement reports it (the scheduler then leaves it out until
    # it heartbeats again); a failure that names nobody reports nothing, and neither does a retry
    # after a refused placement (that Place already carried the report).
    busy = RateLimitedError("decode_kv_full", retry_after_s=1)
    script = Script(("fail", 2, "decode-1"), ("refuse", busy), ("fail", 1), ("fail", 0, "prefill-0"), ("ok",))
    events, _ = asyncio.run(run(script))
    assert tokens(events) == REPLY
    assert [r.unreachable for r in script.seen] == [(), ("decode-1",), (), (), ("prefill-0",)]
