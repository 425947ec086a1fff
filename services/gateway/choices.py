"""``n`` choices of one prompt (docs/api.md, "n > 1"): their requests, and reading them together.

A backend gives the choices' event streams (``Backend.generate_choices``). The gRPC backend
serves them with one placement (``choice_group``): prefill computes the prompt once and samples
the n first tokens from the same logits; decode shares the prompt's full KV blocks among the
choices and copies its last partial block per choice. A choice that stops early (stop string)
is aborted alone in decode; if the placement fails, each unfinished choice migrates on its own
as the request ``<id>-c<i>`` (``choice_requests``), the prompt plus its own tokens. A backend
without a shared placement serves each choice as that request from the start (``fan_out``).

Seeds: choice 0 samples with the request's ``seed`` itself (so ``n = 1`` and choice 0 of ``n``
agree); choice i > 0 with ``choice_seed(seed, i)``, a fixed function of both, in the gateway and
the engines alike. Without a seed every choice is an independent draw.

The handlers read a prompt's choice 0 (its *leader*) first, then every choice concurrently.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from crescent.services.contract.choices import MAX_CHOICES, choice_seed
from crescent.services.gateway.backend import Backend, BackendEvent, GenerationRequest, RequestId

__all__ = ["MAX_CHOICES", "choice_seed", "choice_requests", "fan_out", "all_or_none", "collect_choices",
           "leaders_first", "resumed"]

T = TypeVar("T")
E = TypeVar("E")


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The ``n`` backend requests of one prompt; with ``n = 1``, ``request`` itself (same id)."""
    if n == 1:
        return [request]
    return [
        replace(request, request_id=RequestId(f"{request.request_id}-c{i}"),
                sampling=replace(request.sampling, seed=choice_seed(request.sampling.seed, i)))
        for i in range(n)
    ]


def fan_out(backend: Backend, request: GenerationRequest, n: int) -> list[AsyncGenerator[BackendEvent, None]]:
    """``n`` choices as ``n`` separate generations (``generate_choices`` of a backend without groups)."""
    return [backend.generate(r) for r in choice_requests(request, n)]


async def all_or_none(work: Sequence[Awaitable[T]]) -> list[T]:
    """Await every item concurrently; the first failure cancels the rest and is raised.

    (``asyncio.gather`` would leave the others running; a ``TaskGroup`` would wrap the error.)
    """
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # on a failure, and when this wait itself is cancelled (client gone, drain)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    return [task.result() for task in tasks]


async def resumed(first: E | None, events: AsyncGenerator[E, None]) -> AsyncGenerator[E, None]:
    """``events`` with ``first`` (already read from it, or None) in front."""
    if first is not None:
        yield first
    async for event in events:
        yield event


async def close_all(events: Sequence[AsyncGenerator[E, None]]) -> None:
    """Close every choice's generation, started or not (``owning``)."""
    for e in events:
        await e.aclose()


async def leaders_first(events: Sequence[AsyncGenerator[E, None]], leaders: Sequence[int]) -> dict[int, E]:
    """The first event of each leader, awaited together; any failure (or cancellation) closes
    every generation and is raised. The other choices are not started: their caller starts them."""
    try:
        firsts = await all_or_none([anext(events[i]) for i in leaders])
    except BaseException:
        await close_all(events)
        raise
    return dict(zip(leaders, firsts))


async def collect_choices(
    events: Sequence[AsyncGenerator[E, None]],
    leaders: Sequence[int],
    collect: Callable[[AsyncGenerator[E, None], E | None], Awaitable[T]],
) -> list[T]:
    """Every choice collected by ``collect(events, its first event or None)``, in choice order:
    the leaders' first events first, then all choices concurrently. However it ends, every
    generation is closed; the first failure cancels the others and is raised."""
    firsts = await leaders_first(events, leaders)
    try:
        return await all_or_none([collect(e, firsts.get(i)) for i, e in enumerate(events)])
    finally:
        await close_all(events)
