"""Graceful drain: on SIGTERM the gateway stops taking work but finishes what it has.

``begin`` turns ``/health`` to 503 at once (the load balancer stops sending) and answers new
completions 503 + ``Retry-After`` (the gateway keeps listening, so a request that still arrives
gets an answer a client can act on instead of a refused connection). In-flight requests run to
completion; when the grace runs out, ``end_grace`` makes each one still running end with an
explicit error (streams: an error event with a ``finish_reason``, then ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from crescent.services.gateway.errors import ServiceUnavailableError, error_response
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)

T = TypeVar("T")

_GUARDED_PREFIX = "/v1/"  # the API; /health and /metrics answer throughout
_RETRY_AFTER_S = 1.0


class GatewayDrainingError(ServiceUnavailableError):
    code = "gateway_draining"

    def __init__(self, message: str = "the gateway is shutting down; retry on another instance") -> None:
        super().__init__(message, retry_after_s=_RETRY_AFTER_S)


class Drain:
    """The gateway's shutdown state: draining or not, requests in flight, grace over or not."""

    def __init__(self) -> None:
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._grace_over: asyncio.Future[None] | None = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def begin(self) -> None:
        self.draining = True

    def end_grace(self) -> None:
        """End every request still running with an error (see ``race``)."""
        grace_over = self._grace_future()
        if not grace_over.done():
            grace_over.set_result(None)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _grace_future(self) -> asyncio.Future[None]:
        if self._grace_over is None:
            self._grace_over = asyncio.get_running_loop().create_future()
        return self._grace_over

    async def race(self, work: Awaitable[T]) -> T:
        """Await ``work``, unless the grace runs out first: then cancel it and raise ``GatewayDrainingError``."""
        grace_over = self._grace_future()
        task = asyncio.ensure_future(work)
        if not grace_over.done():
            try:
                await asyncio.wait({task, grace_over}, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise
            if task.done():
                return task.result()
        task.cancel()  # runs the backend's cleanup: its calls cancelled, decode told to abort
        await asyncio.gather(task, return_exceptions=True)
        raise GatewayDrainingError("the gateway shut down before the request finished")

    def request_started(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def request_ended(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()


class DrainGuard:
    """ASGI middleware: refuses new API requests while draining, counts those in flight."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(_GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await error_response(GatewayDrainingError())(scope, receive, send)
            return
        self.drain.request_started()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.request_ended()
