"""The live instance registry: who is registered, their last reported load, who is alive.

The clock is injected so tests can age heartbeats without sleeping. Each record keeps the
reservations of requests placed on the instance that its reports do not cover yet
(``reservations.py``), so a burst of requests does not all land on the same "idle" instance and
a request is never counted twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from crescent.services.scheduler.datatypes import InstanceId, Role
from crescent.services.scheduler.reservations import ReservationBook

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    instance_id: InstanceId
    role: Role
    address: str
    model_id: str
    block_size: int
    kv_capacity_tokens: int
    max_batch_size: int
    kv_format: str = ""         # must agree across a model's instances ("" : not stated)
    kv_dtype: str = ""
    context_window: int = 0     # prompt + completion tokens served; must agree too (0: not stated)


@dataclass(frozen=True, slots=True)
class LoadReport:
    queued_requests: int = 0
    queued_tokens: int = 0
    running_requests: int = 0
    free_kv_tokens: int = 0
    active_request_ids: tuple[str, ...] = ()    # requests the instance holds now
    finished_request_ids: tuple[str, ...] = ()  # requests it let go of since its last report
    draining: bool = False
    # An aggregated instance's prompts (the fields above are then its decoding sequences').
    prefill_queued_requests: int = 0
    prefill_queued_tokens: int = 0
    prefill_running_requests: int = 0

    def prefill_queue(self, role: Role) -> tuple[int, int, int]:
        """(queued requests, queued prompt tokens, running requests) of the instance's prefill work."""
        if role is Role.AGGREGATED:
            return self.prefill_queued_requests, self.prefill_queued_tokens, self.prefill_running_requests
        return self.queued_requests, self.queued_tokens, self.running_requests


@dataclass(slots=True)
class InstanceRecord:
    spec: InstanceSpec
    load: LoadReport
    last_seen: float
    # Placed here: pending (not covered by ``load`` yet) and held (listed by the instance).
    reservations: ReservationBook = field(default_factory=lambda: ReservationBook(keep_held=True))
    reports_request_ids: bool = False  # False so far: maybe an older instance that lists no requests
    registered_at: float = field(default=0.0)
    assumed: bool = False  # discovered, not registered by itself: its details are guesses
    # An aggregated instance's prefill placements, apart from its decode ones (same request ids).
    prefill_book: ReservationBook | None = None
    # When a caller last reported it unreachable (None: never, or it heartbeated since): it is
    # not placed on until a heartbeat newer than that report shows it alive.
    unreachable_since: float | None = None

    @property
    def prefill_reservations(self) -> ReservationBook:
        return self.prefill_book if self.prefill_book is not None else self.reservations

    def books(self) -> tuple[ReservationBook, ...]:
        return (self.reservations,) if self.prefill_book is None else (self.reservations, self.prefill_book)

    @property
    def placeable(self) -> bool:
        return not self.load.draining and self.unreachable_since is None


class UnknownInstanceError(KeyError):
    """A heartbeat from an instance that is not registered (e.g. after a scheduler restart)."""


class InstanceRegistry:
    def __init__(self, heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._records: dict[InstanceId, InstanceRecord] = {}

    def register(self, spec: InstanceSpec, assumed: bool = False) -> None:
        now = self._clock()
        previous = self._records.get(spec.instance_id)
        if previous is not None and previous.spec != spec:
            log.info("instance %s re-registered with new details", spec.instance_id)
        load = LoadReport(free_kv_tokens=spec.kv_capacity_tokens)
        book = ReservationBook(keep_held=spec.role is not Role.KVSTORE)
        prefill_book = ReservationBook(keep_held=True) if spec.role is Role.AGGREGATED else None
        self._records[spec.instance_id] = InstanceRecord(spec, load, last_seen=now, reservations=book, registered_at=now,
                                                         assumed=assumed, prefill_book=prefill_book)
        log.info("registered %s instance %s at %s", spec.role.value, spec.instance_id, spec.address)

    def heartbeat(self, instance_id: InstanceId, load: LoadReport) -> None:
        record = self._records.get(instance_id)
        if record is None:
            raise UnknownInstanceError(instance_id)
        record.load = load
        record.last_seen = now = self._clock()
        if record.unreachable_since is not None and now > record.unreachable_since:
            log.info("instance %s heartbeats again after it was reported unreachable; placing on it again", instance_id)
            record.unreachable_since = None
        if load.active_request_ids or load.finished_request_ids:
            record.reports_request_ids = True
        if record.reports_request_ids:
            for book in record.books():
                book.apply_report(load.active_request_ids, load.finished_request_ids, now)
            if record.spec.role.serves(Role.DECODE):
                record.reservations.mark_running(load.running_requests, now)
        elif load.running_requests or load.queued_requests:
            # Busy without listing a request: an older instance, whose totals cover all it got.
            # (An idle one without ids is still waiting for what was placed on it.)
            for book in record.books():
                book.clear_pending()

    def touch(self, instance_id: InstanceId) -> None:
        """Alive without a load report (e.g. its Kubernetes endpoint is ready); the last load stays.
        Weaker than a heartbeat (a killed pod's endpoint stays ready a moment): it takes an
        instance reported unreachable back only after a heartbeat timeout."""
        record = self._records.get(instance_id)
        if record is not None:
            record.last_seen = now = self._clock()
            since = record.unreachable_since
            if since is not None and now - since > self.heartbeat_timeout_s:
                record.unreachable_since = None

    def mark_unreachable(self, instance_id: InstanceId) -> bool:
        """A caller could not reach the instance: leave it out of placement until it heartbeats
        (or registers) again. True when this report took it out (it was placeable until now)."""
        record = self._records.get(instance_id)
        if record is None or record.unreachable_since is not None:
            return False
        record.unreachable_since = self._clock()
        log.warning("instance %s reported unreachable; not placing on it until it heartbeats again", instance_id)
        return True

    def remove(self, instance_id: InstanceId) -> bool:
        """Forget an instance now (it is known to be gone); False if it was not registered."""
        return self._records.pop(instance_id, None) is not None

    def live(self, role: Role) -> list[InstanceRecord]:
        deadline = self._clock() - self.heartbeat_timeout_s
        return [r for r in self._records.values() if r.spec.role.serves(role) and r.last_seen >= deadline]

    def placeable(self, role: Role) -> list[InstanceRecord]:
        """Live and taking new work (not draining)."""
        return [r for r in self.live(role) if r.placeable]

    def expire_reservations(self, timeout_s: float) -> int:
        """Drop reservations no report covered within ``timeout_s`` (a lost report, a lost request)."""
        deadline = self._clock() - timeout_s
        return sum(book.expire(deadline) for r in self._records.values() for book in r.books())

    def expire(self) -> list[InstanceId]:
        """Forget instances silent for longer than the timeout; return their ids."""
        deadline = self._clock() - self.heartbeat_timeout_s
        dead = [i for i, r in self._records.items() if r.last_seen < deadline]
        for instance_id in dead:
            del self._records[instance_id]
            log.warning("instance %s stopped heartbeating; dropped from placement", instance_id)
        return dead

    def all(self) -> list[InstanceRecord]:
        return list(self._records.values())

    def get(self, instance_id: InstanceId) -> InstanceRecord | None:
        return self._records.get(instance_id)

    def age_s(self, record: InstanceRecord) -> float:
        return max(0.0, self._clock() - record.last_seen)
