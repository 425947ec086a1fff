"""A deadline on request headers: a connection that does not finish them in time is closed.

uvicorn closes an idle keep-alive connection after a few seconds, but any byte resets that
timer, so a client that sends one header byte every few seconds (slowloris) holds its connection
forever; a few hundred of them hold every socket the gateway has. Here each request's headers
must arrive in full within ``header_timeout_s`` of the connection opening or of the request's
first byte (a kept-alive connection between requests is uvicorn's keep-alive timer's). Then the
client gets ``408`` and the connection is closed. Bodies have their own deadline (``HttpGuard``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from crescent.services.common.metrics import gateway_metrics

log = logging.getLogger(__name__)

_TIMEOUT_TEXT = b"the request headers did not arrive in time\n"
_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(_TIMEOUT_TEXT), _TIMEOUT_TEXT))


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with the header deadline; ``with_deadline`` sets its length."""

    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    @classmethod
    def with_deadline(cls, seconds: float) -> type[HeaderDeadlineProtocol]:
        return type(cls.__name__, (cls,), {"header_timeout_s": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in (h11 moved on to the body)
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        gateway_metrics().header_timeouts.inc()
        log.info("closed a connection from %s: its request headers took over %g s", self.client, self.header_timeout_s)
        self.transport.write(_TIMED_OUT)
        self.transport.close()
