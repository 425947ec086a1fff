"""Host-pool room granted to a writer and not yet committed, given back when it expires.

Room is reserved by ``ReserveShm`` (whatever mover then fills it) and turned into blocks by
``CommitShm``. A writer that never commits (it died) has its room given back after the
reservation's lifetime — except while a side-channel transfer is still writing into that room:
then it waits for the transfer to end (its socket times out), so freed room is never written.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

from crescent.protos import common_pb2
from crescent.services.kvstore.store import TieredStore
from crescent.services.kvstore.tier import SpaceReservation
from crescent.services.kvwire.side_channel import SideChannelServer

# (header, room): no header for room reserved ahead, no room for a block held already
Slot = tuple[common_pb2.BlockMeta | None, SpaceReservation | None]


@dataclass(eq=False)
class Landing:
    """A side-channel transfer into a reservation's granted room."""

    token: bytes
    done: asyncio.Future  # one bool per granted slot: landed with the header's CRC
    mover: str = "tcp"


@dataclass(eq=False)
class Pending:
    deadline: float
    slots: list[Slot]
    landing: Landing | None = None
    mover: str = ""  # "" shared memory, "tcp", "nixl"


class PendingReservations:
    def __init__(self, store: TieredStore, lifetime_ms: int, side: SideChannelServer | None = None) -> None:
        self._store = store
        self._side = side
        self.lifetime_s = lifetime_ms / 1000
        self._ids = itertools.count(1)
        self._pending: dict[int, Pending] = {}

    def add(self, slots: list[Slot], landing: Landing | None = None, mover: str = "", lifetime_s: float | None = None) -> int:
        """``lifetime_s``: how long until the room goes back uncommitted (default ``lifetime_s``)."""
        rid = next(self._ids)
        deadline = time.monotonic() + (self.lifetime_s if lifetime_s is None else lifetime_s)
        self._pending[rid] = Pending(deadline, slots, landing, mover)
        return rid

    def take(self, rid: int) -> Pending | None:
        return self._pending.pop(rid, None)

    def _landing_busy(self, pending: Pending) -> bool:
        """A transfer still writing into this room: it cannot be given back yet."""
        landing = pending.landing
        if landing is None or landing.done.done() or self._side is None:
            return False
        return not self._side.withdraw(landing.token)  # withdrawn: nobody will write now

    def expire(self, *, everything: bool = False) -> int:
        """Give back the room of reservations past their deadline (or all); how many blocks' worth."""
        now, expired = time.monotonic(), 0
        for rid in [r for r, p in self._pending.items() if everything or p.deadline <= now]:
            if self._landing_busy(self._pending[rid]) and not everything:
                continue
            for _, reservation in self._pending.pop(rid).slots:
                if reservation is not None:
                    self._store.release(reservation)
                    expired += 1
        return expired
