"""``n`` choices of one prompt, as a fan-out of ordinary generations (docs/api.md, "n > 1").

Each choice is a ``GenerationRequest`` of its own (request id ``<id>-c<i>``), so admission,
placement, migration, ``Abort`` and the stop rule work per choice exactly as for ``n = 1``.

Prefill once: a prompt's choice 0 (its *leader*) starts first; the others start when it has its
first token. By then prefill holds the prompt's full blocks and is writing them to the kvstore,
so the cache-aware scheduler places the others where those blocks are, and each recomputes only
the prompt's last partial block. (Decode still holds each choice's own copy of the prompt's KV.)

Seeds: choice 0 samples with the request's ``seed`` itself (so ``n = 1`` and choice 0 of ``n``
agree); choice i > 0 with ``choice_seed(seed, i)``, a fixed function of both. Without a seed
every choice is an independent draw.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from crescent.services.common.choices import MAX_CHOICES, choice_seed
from crescent.services.gateway.backend import GenerationRequest, RequestId

__all__ = ["MAX_CHOICES", "choice_seed", "choice_requests", "all_or_none", "collect_choices", "leaders_first", "resumed"]

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
    """Close every choice's generation (a choice never started has no backend call to undo)."""
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
