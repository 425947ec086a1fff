"""Decode's handoff side channel: where prefill writes a layer-wise handoff's KV over TCP
(``kvwire/handoff_tcp.py``) when shared memory cannot reach it (another pod or host).

``OpenHandoff`` calls ``open``: a ``HandoffLanding`` (the flat buffer) registered with the
side channel under a fresh one-time token. The Handoff whose header names that token ``take``s
it. A landing no Handoff took within ``OPEN_TTL_S`` (its prefill died, or fell back to gRPC
bytes) is dropped with its token; so that open landings cannot hold more memory than a few
whole caches, ``open`` refuses beyond ``max_open_bytes``.
"""

from __future__ import annotations

import logging
import time

from crescent.services.common.metrics import handoff_metrics
from crescent.services.kvwire.handoff_tcp import HandoffLanding
from crescent.services.kvwire.side_channel import SideChannelServer, SideTls

log = logging.getLogger(__name__)

OPEN_TTL_S = 120.0  # an opened handoff's header comes within this (the prompt computes in between)
MAX_CONNECTIONS = 256  # handoffs in flight at once (each holds its connection while its prompt computes)


class HandoffTooLarge(ValueError):
    """An ``OpenHandoff`` for more bytes than this instance takes (RESOURCE_EXHAUSTED)."""


class HandoffSideChannel:
    """The side channel's listener and the handoffs opened on it, by token."""

    def __init__(self, host: str, port: int, advertise_host: str, max_bytes: int,
                 server_tls: SideTls | None = None) -> None:
        """``max_bytes``: the largest handoff (the KV of a whole cache); ``server_tls``: mutual
        TLS on the side channel (the process's gRPC key pair)."""
        self.server = SideChannelServer(host, port, server_tls=server_tls, max_connections=MAX_CONNECTIONS,
                                        on_refused=handoff_metrics().side_refused.inc)
        self.address = f"{'tls://' if server_tls is not None else ''}{advertise_host}:{self.server.port}"
        self.max_bytes = max_bytes
        self.max_open_bytes = 4 * max_bytes
        self._open: dict[bytes, HandoffLanding] = {}

    def open(self, request_id: str, total_bytes: int) -> bytes:
        """Room for a handoff of ``total_bytes``: its token. ``ValueError`` for a size that is
        not one, ``HandoffTooLarge`` past this instance's bounds."""
        self._expire()
        if total_bytes <= 0:
            raise ValueError(f"total_bytes must be > 0, not {total_bytes}")
        if total_bytes > self.max_bytes:
            raise HandoffTooLarge(f"a handoff of {total_bytes} bytes; this decode instance's whole cache holds {self.max_bytes}")
        held = sum(len(landing.buf) for landing in self._open.values())
        if held + total_bytes > self.max_open_bytes:
            raise HandoffTooLarge(f"{held} bytes of handoffs opened and not yet sent; {total_bytes} more would pass "
                                  f"{self.max_open_bytes}")
        landing = HandoffLanding(request_id, total_bytes)
        token, done = self.server.expect_stream(landing.serve)
        done.add_done_callback(_settled)
        self._open[token] = landing
        return token

    def take(self, token: bytes, request_id: str) -> HandoffLanding | None:
        """The landing of ``token`` for the handoff of ``request_id``; None: none (expired, or
        never issued here)."""
        landing = self._open.get(token)
        if landing is None or landing.request_id != request_id:
            return None
        del self._open[token]
        return landing

    def _expire(self) -> None:
        now = time.monotonic()
        for token, landing in list(self._open.items()):
            if now - landing.opened_at > OPEN_TTL_S:
                del self._open[token]
                self.server.withdraw(token)
                landing.close()
                log.info("handoff %s opened on the side channel but never sent: dropped", landing.request_id)

    def close(self) -> None:
        self.server.close()
        for landing in self._open.values():
            landing.close()
        self._open.clear()


def _settled(done) -> None:  # noqa: ANN001 - the side channel's future of one stream
    """A stream's end is its landing's business (its waiters see it); the future's error is read
    here so that asyncio does not report it as never retrieved."""
    if not done.cancelled():
        done.exception()
