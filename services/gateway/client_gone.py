"""Noticing a client that goes away while its request is worked on, before any response is sent.

Starlette notices a disconnect only while a streaming response is being sent; before that (a
long prefill, a whole non-streamed completion) nobody would, and decode would keep going.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected while its request was being worked on."""


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientGone``."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if not task.done():
        task.cancel()  # runs the backend's cleanup: in-flight calls cancelled, decode told
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()
