"""Which byte mover a layer-wise handoff uses with each decode instance.

Shared memory (``kvwire/handoff_shm.py``) when it is on and the decode instance has not refused
it yet; gRPC bytes otherwise: a decode on another host (or pod, or user) refuses the segment
once, prefill sends that handoff again as bytes (``layerwise.py``) and remembers the peer, so
each (prefill, decode) pair settles on its mover by itself. A decode built before this mover
reads the header's segment fields as unknown and refuses the data-less slices (INVALID_ARGUMENT,
or UNKNOWN from a stand-in): until a peer has taken one shared memory handoff, that counts as a
refusal too, so prefill can be upgraded before decode. Metrics: ``crescent_handoff_total``
and ``crescent_handoff_bytes_total`` by peer and mover.
"""

from __future__ import annotations

import logging

import grpc

from crescent.services.common.metrics import handoff_metrics
from crescent.services.kvwire import shm_files
from crescent.services.kvwire.handoff_shm import REFUSAL, HandoffSegment, ShmUnusable, instance_tag, sweep

log = logging.getLogger(__name__)

SHM, GRPC = "shm", "grpc"


class HandoffMovers:
    """One prefill instance's movers: its segments' name tag, the peers that refused shared memory."""

    def __init__(self, instance_id: str, shared_memory: bool) -> None:
        """``shared_memory``: try shared memory with every peer (the ``shm_handoff`` setting)."""
        self.tag = instance_tag(instance_id)
        self.shared_memory = shared_memory and shm_files.available()
        self._refused: set[str] = set()  # decode addresses that cannot map our segments
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

    def refused(self, peer: str, exc: grpc.aio.AioRpcError) -> bool:
        """Whether a shared memory handoff's failure ``exc`` means ``peer`` cannot take them (it
        said so, or it never took one and did not understand the stream): if so, gRPC bytes
        with it from now on, and this handoff is sent again."""
        code, why = exc.code(), exc.details() or ""
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
        self.metrics.handoffs.labels(peer, mover).inc()
        self.metrics.moved_bytes.labels(peer, mover).inc(nbytes)
