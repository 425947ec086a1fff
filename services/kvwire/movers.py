"""One family of byte movers: the ways this process moves KV bytes to a peer, fastest first,
each one refused per peer (for good, or for a backoff), gRPC always last and always there.

Three users ask it the same three questions — which ways are open to this peer now (``open``),
the peer or this host cannot do one (``refuse``), bytes went one way (``moved``):

- the kvstore client, one ladder per node, its movers objects (``kvstore/movers/``: cuda_ipc
  for device blocks on the node's GPU, shm, tcp, nixl, grpc);
- the layer-wise handoff to decode, one ladder per prefill process over every decode peer
  (``prefill/handoff_mover.py``: shm, tcp, grpc), with a backoff on tcp so a blip does not send
  a peer's handoffs over gRPC for good;
- the kvstore node's same-GPU path (``kvstore/cuda_ipc.py``: cuda_ipc, refused per engine peer
  when its GPU differs or IPC fails; host bytes, the ladder's last rung, otherwise).

What a mover does with bytes stays with the mover; what a refusal looks like on the wire is
``said_no`` (a status that says "never from here"), plus the handoff's own refusal notes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

log = logging.getLogger(__name__)

GRPC = "grpc"  # the fallback every ladder ends with: works from anywhere

# Statuses that say the peer cannot do this for us at all (another host, a feature off or
# missing, a role not allowed to), as opposed to a call that failed this time.
REFUSING_CODES = frozenset({
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED,
})


def said_no(exc: BaseException) -> bool:
    """Whether ``exc`` is a peer's refusal of a mover (``REFUSING_CODES``), not a passing failure."""
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in REFUSING_CODES


@dataclass(frozen=True, slots=True)
class Backoff:
    """A refused mover is tried again after ``first_s``, doubling each time it fails again up to
    ``max_s``; a move that worked starts it afresh."""

    first_s: float
    max_s: float


class MoverMetrics(Protocol):
    """Where a ladder reports (each user keeps its own metric names)."""

    def moved(self, peer: str, mover: str, direction: str, nbytes: int) -> None: ...

    def selected(self, peer: str, mover: str, names: Sequence[str]) -> None: ...

    def refused(self, peer: str, mover: str) -> None: ...


class MoverLadder:
    """Mover names in order, fastest first, ``GRPC`` appended last; per (peer, mover) refusals.

    A refusal is for good unless the mover has a ``Backoff``; ``worked`` marks a mover confirmed
    with a peer (it took bytes that way) and ends any backoff. ``open(peer)`` is the ladder to
    climb down for the next move; it is never empty."""

    def __init__(self, names: Iterable[str], *, backoffs: dict[str, Backoff] | None = None,
                 metrics: MoverMetrics | None = None, what: str = "peer") -> None:
        """``what``: how logs name a peer ("kvstore", "decode")."""
        order = list(dict.fromkeys(names))
        if GRPC not in order:
            order.append(GRPC)
        self.names: tuple[str, ...] = tuple(order)
        self._backoffs = backoffs or {}
        self._metrics = metrics
        self._what = what
        self._for_good: set[tuple[str, str]] = set()
        self._retry: dict[tuple[str, str], tuple[float, float]] = {}  # -> (try again at, backoff)
        self._confirmed: set[tuple[str, str]] = set()
        self._selected: dict[str, str] = {}  # peer -> the mover that moved its last bytes

    def allows(self, peer: str, mover: str) -> bool:
        """Whether ``mover`` may be tried with ``peer`` now (``GRPC`` always may)."""
        if mover == GRPC:
            return True
        if (peer, mover) in self._for_good:
            return False
        retry = self._retry.get((peer, mover))
        return retry is None or time.monotonic() >= retry[0]

    def open(self, peer: str) -> list[str]:
        """The movers to try with ``peer`` now, in order; ends with ``GRPC``."""
        return [name for name in self.names if self.allows(peer, name)]

    def confirmed(self, peer: str, mover: str) -> bool:
        """Whether ``mover`` has moved bytes to ``peer`` (its refusals are then taken at their word only)."""
        return (peer, mover) in self._confirmed

    def refuse(self, peer: str, mover: str, why: str) -> float | None:
        """``peer`` (or this host) cannot use ``mover``: not tried with it again, or not before
        its backoff passes. Returns that backoff (None: for good)."""
        assert mover != GRPC, "the fallback is never refused"
        backoff = self._backoffs.get(mover)
        if self._metrics is not None:
            self._metrics.refused(peer, mover)
        if backoff is None:
            if (peer, mover) not in self._for_good:
                log.info("%s %s: mover %s is not usable from here (%s); using the next one",
                         self._what, peer, mover, why)
            self._for_good.add((peer, mover))
            return None
        previous = self._retry.get((peer, mover))
        wait = backoff.first_s if previous is None else min(previous[1] * 2, backoff.max_s)
        self._retry[(peer, mover)] = (time.monotonic() + wait, wait)
        log.info("%s %s: mover %s is not usable from here (%s); the next one for %g s, then it is "
                 "tried again", self._what, peer, mover, why, wait)
        return wait

    def worked(self, peer: str, mover: str) -> None:
        """Bytes went to ``peer`` over ``mover``: confirmed, and a later failure backs off afresh."""
        self._confirmed.add((peer, mover))
        self._retry.pop((peer, mover), None)

    def moved(self, peer: str, mover: str, direction: str, nbytes: int) -> None:
        """Count ``nbytes`` moved with ``peer`` over ``mover`` (and which mover is in use)."""
        if self._metrics is None:
            return
        if self._selected.get(peer) != mover:
            self._selected[peer] = mover
            self._metrics.selected(peer, mover, self.names)
        self._metrics.moved(peer, mover, direction, nbytes)
