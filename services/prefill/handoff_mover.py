"""Which byte mover a layer-wise handoff uses with each decode instance.

Shared memory (``kvwire/handoff_shm.py``) when it is on and the decode instance has not refused
it yet; else decode's TCP side channel (``kvwire/handoff_tcp.py``) when it is on and the decode
instance has not refused it (no side channel, ``OpenHandoff`` unknown or failed, its socket
unreachable, or a handoff over it broke); gRPC bytes otherwise: a decode on another host (or pod, or user) refuses the segment
once, prefill sends that handoff again as bytes (``layerwise.py``) and remembers the peer, so
each (prefill, decode) pair settles on its mover by itself. A decode built before this mover
reads the header's segment fields as unknown and refuses the data-less slices (INVALID_ARGUMENT,
or UNKNOWN from a stand-in): until a peer has taken one shared memory handoff, that counts as a
refusal too, so prefill can be upgraded before decode. Each mover is refused per peer on its
own: a decode in another pod refuses shared memory once, then takes TCP. A side channel found
unusable is tried again after a backoff (``TCP_RETRY_FIRST_S`` doubling to ``TCP_RETRY_MAX_S``,
back to nothing after a handoff that went over it): a network blip or a flood of connections
that held its slots for a while does not send that peer's handoffs over gRPC for the rest of the
process's life. Metrics: ``crescent_handoff_total`` and ``crescent_handoff_bytes_total`` by peer
and mover.
"""

from __future__ import annotations

import logging
import ssl
import time

import grpc

from crescent.services.common.metrics import handoff_metrics
from crescent.services.common.tls import PeerTls
from crescent.services.kvwire import shm_files
from crescent.services.kvwire.handoff_shm import REFUSAL, HandoffSegment, ShmUnusable, instance_tag, sweep
from crescent.services.kvwire.handoff_tcp import TCP_REFUSAL
from crescent.services.kvwire.side_channel import SideTls, dial_target

log = logging.getLogger(__name__)

SHM, TCP, GRPC = "shm", "tcp", "grpc"
TCP_RETRY_FIRST_S = 5.0    # a side channel found unusable is tried again after this...
TCP_RETRY_MAX_S = 300.0    # ...doubling each time it fails again, up to this
# OpenHandoff failures that say the peer has no usable side channel (others: gRPC this time only)
_NO_SIDE_CHANNEL = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION)


class HandoffMovers:
    """One prefill instance's movers: its segments' name tag, the peers that refused shared memory."""

    def __init__(self, instance_id: str, shared_memory: bool, tcp: bool = False, tls: PeerTls | None = None) -> None:
        """``shared_memory``: try shared memory with every peer (the ``shm_handoff`` setting);
        ``tcp``: then decode's side channel (``tcp_handoff``), with ``tls`` when it asks for it."""
        self.tag = instance_tag(instance_id)
        self.shared_memory = shared_memory and shm_files.available()
        self.tcp = tcp
        self._side_tls = SideTls(tls) if tls is not None and tcp else None
        self._server_name = tls.server_name if tls is not None else ""
        self._refused: set[str] = set()  # decode addresses that cannot map our segments
        self._tcp_retry: dict[str, tuple[float, float]] = {}  # decode address -> (try again at, backoff)
        self._confirmed: set[str] = set()  # decode addresses that took a shared memory handoff
        self.metrics = handoff_metrics()
        if self.shared_memory:
            removed = sweep(self.tag)
            if removed:
                log.info("removed %d handoff segments an earlier process of this instance left in %s",
                         removed, shm_files.SHM_DIR)

    def segment(self, peer: str, nbytes: int) -> HandoffSegment | None:
        """A segment for a handoff of ``nbytes`` to ``peer``, or None: gRPC bytes this time."""
        if not self.shared_memory or peer in self._refused:
            return None
        try:
            return HandoffSegment.create(self.tag, nbytes)
        except ShmUnusable as exc:
            log.warning("handoff to %s over gRPC: %s", peer, exc)
            return None

    def uses_tcp(self, peer: str) -> bool:
        """Whether a handoff to ``peer`` that shared memory does not take tries its side channel."""
        if not self.tcp:
            return False
        retry = self._tcp_retry.get(peer)
        return retry is None or time.monotonic() >= retry[0]

    def side_target(self, peer: str, side_address: str) -> tuple[str, ssl.SSLContext | None, str]:
        """(address to connect to, TLS context, server name) for ``peer``'s side channel as
        OpenHandoff advertised it."""
        address, context = dial_target(side_address, peer, self._side_tls.client() if self._side_tls else None)
        return address, context, self._server_name

    def tcp_failed(self, peer: str, exc: BaseException) -> None:
        """Opening a handoff on ``peer``'s side channel failed with ``exc``: gRPC bytes this time;
        from now on too unless it was a passing refusal (draining, too large, a deadline)."""
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in _NO_SIDE_CHANNEL:
            log.info("handoff to %s over gRPC this time: OpenHandoff said %s", peer, exc.code().name)
            return
        self._refuse_tcp(peer, exc.details() if isinstance(exc, grpc.aio.AioRpcError) else repr(exc))

    def _refuse_tcp(self, peer: str, why: str) -> None:
        previous = self._tcp_retry.get(peer)
        backoff = TCP_RETRY_FIRST_S if previous is None else min(previous[1] * 2, TCP_RETRY_MAX_S)
        self._tcp_retry[peer] = (time.monotonic() + backoff, backoff)
        log.info("decode %s's handoff side channel is not usable from here (%s): handoffs to it go over gRPC "
                 "for %g s, then it is tried again", peer, why, backoff)
        self.metrics.tcp_refused.labels(peer).inc()

    def refused(self, peer: str, exc: grpc.aio.AioRpcError, mover: str = SHM) -> bool:
        """Whether a ``mover`` (shared memory or TCP) handoff's failure ``exc`` means ``peer``
        cannot take them (it said so, or it never took one and did not understand the stream):
        if so, not that mover with it from now on, and this handoff is sent again as bytes."""
        code, why = exc.code(), exc.details() or ""
        if mover == TCP:  # a decode that issued the token understands the notes: only its word counts
            if code == grpc.StatusCode.FAILED_PRECONDITION and why.startswith(TCP_REFUSAL):
                self._refuse_tcp(peer, why)
                return True
            return False
        said = code == grpc.StatusCode.FAILED_PRECONDITION and why.startswith(REFUSAL)
        if not said and (peer in self._confirmed or code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN)):
            return False
        if peer not in self._refused:
            log.info("decode %s cannot map this prefill's shared memory (%s): handoffs to it go over gRPC", peer, why)
        self._refused.add(peer)
        self.metrics.shm_refused.labels(peer).inc()
        return True

    def handed_off(self, peer: str, mover: str, nbytes: int) -> None:
        if mover == SHM:
            self._confirmed.add(peer)
        elif mover == TCP:
            self._tcp_retry.pop(peer, None)  # it works again: the next failure starts the backoff afresh
        self.metrics.handoffs.labels(peer, mover).inc()
        self.metrics.moved_bytes.labels(peer, mover).inc(nbytes)
