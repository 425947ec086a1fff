"""``Owning``: an event stream that closes what it was built on, even if it never started.

Closing an async generator that never started runs none of its code, so a ``finally`` inside
it cannot be relied on to close the stream it was given. A layer that wraps a stream (a
choice's text over its backend events, its parsed reply over its text) returns ``Owning``, so
that closing the outermost stream, read or not, reaches the backend: a choice of a shared
placement (``choice_group``) must be closed for its placement to be let go.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Owning(AsyncGenerator, Generic[T]):  # type: ignore[type-arg]
    """``events``; closing it closes ``events``, then runs ``close_source`` (both idempotent)."""

    def __init__(self, events: AsyncGenerator[T, None], close_source: Callable[[], Awaitable[None]]) -> None:
        self._events = events
        self._close_source = close_source

    def asend(self, value: None) -> Awaitable[T]:
        return self._events.asend(value)

    def athrow(self, *args: Any) -> Awaitable[T]:
        return self._events.athrow(*args)

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await self._close_source()
