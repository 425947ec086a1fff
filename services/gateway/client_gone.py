"""Noticing a client that goes away while its request is worked on, before any response is sent.

``answered`` records how a request ended, whichever way it ends, for every endpoint alike.

Starlette notices a disconnect only while a streaming response is being sent; before that (a
long prefill, a whole non-streamed completion) nobody would, and decode would keep going.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from crescent.services.gateway.accounting import RequestRecord
from crescent.services.gateway.choice_stream import status_of
from crescent.services.gateway.errors import ApiError
from fastapi import Request
from fastapi.responses import Response

log = logging.getLogger(__name__)

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


async def answered(work: Awaitable[Response], record: RequestRecord, *, before: str) -> Response:
    """``work``'s response, with ``record`` finished however it ends: an ``ApiError`` (re-raised
    for its HTTP answer), the client gone ``before`` anything was sent (499), a cancellation, a bug."""
    try:
        return await work
    except ApiError as exc:
        log.info("request failed: %s %s", exc.status, exc.message)
        record.finish(status_of(exc))
        raise
    except ClientGone:
        log.info("client disconnected before %s", before)
        record.finish("cancelled")
        return Response(status_code=499)  # nobody reads it; the status is for access logs
    except asyncio.CancelledError:
        record.finish("cancelled")
        raise
    except Exception:
        record.finish("error")
        raise
