"""Which byte mover a layer-wise handoff uses with each decode instance.

Shared memory (``kvwire/handoff_shm.py``) when it is on and the decode instance has not refused
it yet; else decode's TCP side channel (``kvwire/handoff_tcp.py``) when it is on and the decode
instance has not refused it (no side channel, ``OpenHandoff`` unknown or failed, its socket
unreachable, or a handoff over it broke); gRPC bytes otherwise: a decode on another host (or
pod, or user) refuses the segment once, prefill sends that handoff again as bytes
(``layerwise.py``) and remembers the peer, so each (prefill, decode) pair settles on its mover
by itself. A decode built before this mover
reads the header's segment fields as unknown and refuses the data-less slices (INVALID_ARGUMENT,
or UNKNOWN from a stand-in): until a peer has taken one shared memory handoff, that counts as a
refusal too, so prefill can be upgraded before decode. Each mover is refused per peer on its
own: a decode in another pod refuses shared memory once, then takes TCP. A side channel found
unusable is tried again after a backoff (``TCP_RETRY_FIRST_S`` doubling to ``TCP_RETRY_MAX_S``,
back to nothing after a handoff that went over it): a network blip or a flood of connections
that held its slots for a while does not send that peer's handoffs over gRPC for the rest of the
process's life. The order, the per-peer refusals and the backoff are a ``MoverLadder``
(``kvwire/movers.py``), the family the kvstore client climbs too. Metrics:
``crescent_handoff_total`` and ``crescent_handoff_bytes_total`` by peer and mover.
"""

from __future__ import annotations

import logging
import ssl

import grpc

from crescent.services.common.metrics import handoff_metrics
from crescent.services.common.tls import PeerTls
from crescent.services.kvwire import shm_files
from crescent.services.kvwire.handoff_shm import REFUSAL, HandoffSegment, ShmUnusable, instance_tag, sweep
from crescent.services.kvwire.handoff_tcp import TCP_REFUSAL
from crescent.services.kvwire.movers import Backoff, MoverLadder, said_no
from crescent.services.kvwire.side_channel import SideTls
from crescent.services.kvwire.side_channel_client import dial_target

log = logging.getLogger(__name__)

SHM, TCP = "shm", "tcp"
TCP_RETRY_FIRST_S = 5.0    # a side channel found unusable is tried again after this...
TCP_RETRY_MAX_S = 300.0    # ...doubling each time it fails again, up to this
# A decode built before shared memory handoffs reads the data-less slices as malformed.
_OLD_DECODE = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN)


class _HandoffMoverMetrics:
    """The ladder's reports as ``crescent_handoff_*``."""

    def __init__(self) -> None:
        self.metrics = handoff_metrics()

    def moved(self, peer: str, mover: str, direction: str, nbytes: int) -> None:
        self.metrics.handoffs.labels(peer, mover).inc()
        self.metrics.moved_bytes.labels(peer, mover).inc(nbytes)

    def selected(self, peer: str, mover: str, names: object) -> None:
        pass  # the handoff counters say which mover each handoff took

    def refused(self, peer: str, mover: str) -> None:
        (self.metrics.shm_refused if mover == SHM else self.metrics.tcp_refused).labels(peer).inc()


class HandoffMovers:
    """One prefill instance's movers: its segments' name tag, and the ladder (shm, tcp, grpc) with
    the decode peers' refusals."""

    def __init__(self, instance_id: str, shared_memory: bool, tcp: bool = False,
                 tls: PeerTls | None = None) -> None:
        """``shared_memory``: try shared memory with every peer (the ``shm_handoff`` setting);
        ``tcp``: then decode's side channel (``tcp_handoff``), with ``tls`` when it asks for it."""
        self.tag = instance_tag(instance_id)
        self.shared_memory = shared_memory and shm_files.available()
        self.tcp = tcp
        self._side_tls = SideTls(tls) if tls is not None and tcp else None
        self._server_name = tls.server_name if tls is not None else ""
        reports = _HandoffMoverMetrics()
        self.metrics = reports.metrics
        names = [SHM] * self.shared_memory + [TCP] * tcp
        self.ladder = MoverLadder(names, backoffs={TCP: Backoff(TCP_RETRY_FIRST_S, TCP_RETRY_MAX_S)},
                                  metrics=reports, what="decode")
        if self.shared_memory:
            removed = sweep(self.tag)
            if removed:
                log.info("removed %d handoff segments an earlier process of this instance left in %s",
                         removed, shm_files.SHM_DIR)

    def segment(self, peer: str, nbytes: int) -> HandoffSegment | None:
        """A segment for a handoff of ``nbytes`` to ``peer``, or None: another mover this time."""
        if SHM not in self.ladder.open(peer):
            return None
        try:
            return HandoffSegment.create(self.tag, nbytes)
        except ShmUnusable as exc:
            log.warning("handoff to %s without shared memory: %s", peer, exc)
            return None

    def uses_tcp(self, peer: str) -> bool:
        """Whether a handoff to ``peer`` that shared memory does not take tries its side channel."""
        return TCP in self.ladder.open(peer)

    def side_target(self, peer: str, side_address: str) -> tuple[str, ssl.SSLContext | None, str]:
        """(address to connect to, TLS context, server name) for ``peer``'s side channel as
        OpenHandoff advertised it."""
        client_tls = self._side_tls.client() if self._side_tls else None
        address, context = dial_target(side_address, peer, client_tls)
        return address, context, self._server_name

    def tcp_failed(self, peer: str, exc: BaseException) -> None:
        """Opening a handoff on ``peer``'s side channel failed with ``exc``: gRPC bytes this time;
        from now on too (for a backoff) unless it was a passing refusal (draining, too large, a deadline)."""
        if isinstance(exc, grpc.aio.AioRpcError) and not said_no(exc):
            log.info("handoff to %s over gRPC this time: OpenHandoff said %s", peer, exc.code().name)
            return
        self.ladder.refuse(peer, TCP, exc.details() if isinstance(exc, grpc.aio.AioRpcError) else repr(exc))

    def refused(self, peer: str, exc: grpc.aio.AioRpcError, mover: str = SHM) -> bool:
        """Whether a ``mover`` (shared memory or TCP) handoff's failure ``exc`` means ``peer``
        cannot take them (it said so, or it never took one and did not understand the stream):
        if so, not that mover with it from now on (TCP: for a backoff), and this handoff is sent
        again as bytes."""
        code, why = exc.code(), exc.details() or ""
        if mover == TCP:  # a decode that issued the token understands the notes: only its word counts
            if code == grpc.StatusCode.FAILED_PRECONDITION and why.startswith(TCP_REFUSAL):
                self.ladder.refuse(peer, TCP, why)
                return True
            return False
        said = code == grpc.StatusCode.FAILED_PRECONDITION and why.startswith(REFUSAL)
        if not said and (self.ladder.confirmed(peer, SHM) or code not in _OLD_DECODE):
            return False
        self.ladder.refuse(peer, SHM, why)
        return True

    def handed_off(self, peer: str, mover: str, nbytes: int) -> None:
        """A handoff to ``peer`` went over ``mover``: confirmed (a TCP backoff starts afresh), counted."""
        self.ladder.worked(peer, mover)
        self.ladder.moved(peer, mover, "out", nbytes)
