"""The ``n`` choices of a prompt served by one placement (docs/api.md, "n > 1").

The group's ``Attempt`` (request id ``<id>``, ``sampling.n = n``) prefills the prompt once,
prefill samples the n first tokens from the same logits, and decode runs the n sequences on the
prompt's shared KV. A pump task sorts the attempt's (index, event) pairs into one queue per
choice, and each choice reads its own.

Each choice is an ordinary migrating generation (``migration``) of the n = 1 request
``<id>-c<i>`` (seed ``choice_seed(seed, i)``) whose first attempt is its view of the group. When
the group's attempt fails, every unfinished choice is placed again on its own (``<id>-c<i>-m1``,
the prompt plus its own tokens); a refusal or an error no placement can fix reaches every choice.

A choice whose reader stops early (a stop string) is aborted alone in decode (``Abort`` with
``one_choice``); when the last reader stops, the pump is cancelled and the attempt's own cleanup
aborts what is left. The pump starts with the first read, and its task is owned by the group:
it ends with the attempt, or is cancelled with the last reader.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial

from crescent.services.gateway.attempts.attempt import Attempt, AttemptCalls, AttemptRequest, run_attempt
from crescent.services.gateway.backend import BackendEvent, GenerationRequest
from crescent.services.gateway.choices import choice_requests
from crescent.services.gateway.attempts.migration import MigrationPolicy, StartAttempt, attempt_request, generate_with_migration
from crescent.services.gateway.owning import Owning


@dataclass(frozen=True, slots=True)
class _Ended:
    error: Exception | None  # what ended the attempt; None: it finished every choice


class ChoiceGroup:
    """One attempt's events, split by choice."""

    def __init__(self, attempt: Attempt) -> None:
        self._attempt = attempt
        self._queues: list[asyncio.Queue[BackendEvent | _Ended]] = [asyncio.Queue() for _ in range(attempt.n)]
        self._reading = set(range(attempt.n))  # choices whose reader has not stopped
        self._pump: asyncio.Task[None] | None = None

    async def choice(self, index: int) -> AsyncGenerator[BackendEvent, None]:
        """Choice ``index``'s events, up to its finish; raises what ended the attempt before it."""
        if self._pump is None:  # the first reader starts the attempt
            self._pump = asyncio.get_running_loop().create_task(
                self._run(), name=f"choices of {self._attempt.request.attempt_id}")
        queue = self._queues[index]
        try:
            while not isinstance(item := await queue.get(), _Ended):
                yield item
                if item.finish_reason is not None:
                    return
            if item.error is not None:
                raise item.error
        finally:
            self.release(index)

    def release(self, index: int) -> None:
        """Choice ``index``'s reader stopped (idempotent). No awaits: it may run in a cancelled task."""
        if index not in self._reading:
            return
        self._reading.discard(index)
        if not self._reading:
            if self._pump is not None:
                self._pump.cancel()
            return
        # A step later: when every choice closes at once (client gone), the pump's cancellation
        # ends them all with one Abort instead of one per choice.
        asyncio.get_running_loop().call_soon(self._drop, index)

    def _drop(self, index: int) -> None:
        if self._reading:
            self._attempt.drop(index)  # a no-op once the choice finished or the attempt ended

    async def close_choice(self, index: int) -> None:
        """``release`` for ``Owning``: a choice closed before it was ever read counts too."""
        self.release(index)

    async def _run(self) -> None:
        try:
            async with aclosing(self._attempt.events()) as events:
                async for index, event in events:
                    if index in self._reading:
                        self._queues[index].put_nowait(event)
        except Exception as exc:  # noqa: BLE001 - every reader hears it (cancelled: nobody is left)
            self._end(exc)
            return
        self._end(None)

    def _end(self, error: Exception | None) -> None:
        for index in self._reading:
            self._queues[index].put_nowait(_Ended(error))


def _group_first(group: ChoiceGroup, index: int, later: StartAttempt) -> StartAttempt:
    """Choice ``index``'s attempts: its view of the group, then ``later`` for each migration."""
    started = False

    def start(request: AttemptRequest) -> AsyncGenerator[BackendEvent, None]:
        nonlocal started
        if started:
            return later(request)
        started = True
        return group.choice(index)

    return start


def choice_streams(calls: AttemptCalls, request: GenerationRequest, n: int, *, deadline: float,
                   clock: Callable[[], float], policy: MigrationPolicy) -> list[AsyncGenerator[BackendEvent, None]]:
    """The events of each of ``request``'s ``n`` choices, served by one placement while it holds."""
    group = ChoiceGroup(Attempt(calls, attempt_request(request, [], 0, n=n), deadline, clock))

    def alone(attempt: AttemptRequest) -> AsyncGenerator[BackendEvent, None]:
        return run_attempt(calls, attempt, deadline, clock)

    return [
        Owning(generate_with_migration(choice, _group_first(group, i, alone), deadline=deadline, clock=clock,
                                       policy=policy),
               partial(group.close_choice, i))
        for i, choice in enumerate(choice_requests(request, n))
    ]
