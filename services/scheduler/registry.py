"""The live instance registry: who is registered, their last reported load, who is alive.

The clock is injected so tests can age heartbeats without sleeping. Between heartbeats the
registry adds the work it has just placed on an instance to its last report, so a burst of
requests inside one heartbeat interval does not all land on the same "idle" instance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from crescent.services.scheduler.datatypes import InstanceId, Role

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


@dataclass(frozen=True, slots=True)
class LoadReport:
    queued_requests: int = 0
    queued_tokens: int = 0
    running_requests: int = 0
    free_kv_tokens: int = 0


@dataclass(slots=True)
class InstanceRecord:
    spec: InstanceSpec
    load: LoadReport
    last_seen: float
    # Placed since the last heartbeat: not yet visible in ``load``.
    pending_requests: int = 0
    pending_tokens: int = 0
    pending_kv_tokens: int = 0
    registered_at: float = field(default=0.0)


class UnknownInstanceError(KeyError):
    """A heartbeat from an instance that is not registered (e.g. after a scheduler restart)."""


class InstanceRegistry:
    def __init__(self, heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._records: dict[InstanceId, InstanceRecord] = {}

    def register(self, spec: InstanceSpec) -> None:
        now = self._clock()
        previous = self._records.get(spec.instance_id)
        if previous is not None and previous.spec != spec:
            log.info("instance %s re-registered with new details", spec.instance_id)
        load = LoadReport(free_kv_tokens=spec.kv_capacity_tokens)
        self._records[spec.instance_id] = InstanceRecord(spec, load, last_seen=now, registered_at=now)
        log.info("registered %s instance %s at %s", spec.role.value, spec.instance_id, spec.address)

    def heartbeat(self, instance_id: InstanceId, load: LoadReport) -> None:
        record = self._records.get(instance_id)
        if record is None:
            raise UnknownInstanceError(instance_id)
        record.load = load
        record.last_seen = self._clock()
        record.pending_requests = record.pending_tokens = record.pending_kv_tokens = 0

    def touch(self, instance_id: InstanceId) -> None:
        """Alive without a load report (e.g. its Kubernetes endpoint is ready); the last load stays."""
        record = self._records.get(instance_id)
        if record is not None:
            record.last_seen = self._clock()

    def remove(self, instance_id: InstanceId) -> bool:
        """Forget an instance now (it is known to be gone); False if it was not registered."""
        return self._records.pop(instance_id, None) is not None

    def note_placed(self, instance_id: InstanceId, tokens: int, kv_tokens: int = 0) -> None:
        record = self._records.get(instance_id)
        if record is not None:
            record.pending_requests += 1
            record.pending_tokens += tokens
            record.pending_kv_tokens += kv_tokens

    def live(self, role: Role) -> list[InstanceRecord]:
        deadline = self._clock() - self.heartbeat_timeout_s
        return [r for r in self._records.values() if r.spec.role is role and r.last_seen >= deadline]

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
