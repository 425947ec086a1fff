"""Where rate-limit state lives: the ``LimitStore`` contract and its in-process implementation.

Three kinds of counter, each under a key the limiter names:

- **rates** (requests and tokens per period): GCRA, a token bucket kept as one number, the
  "theoretical arrival time" ``tat``. A bucket holds ``limit`` units and refills ``limit`` per
  ``period_s`` continuously; a request of ``cost`` units passes when its units fit. So a client
  may spend a whole period's limit at once and then ``limit`` per period: in any interval of
  ``t`` seconds at most ``limit * (1 + t / period_s)`` units pass. ``remaining`` is what the
  bucket holds, ``reset`` the time until it is full again (OpenAI's header semantics).
- **slots** (requests in flight): a set of leases with expiry times. A gateway renews the leases
  of its running requests; a gateway that dies stops renewing, so its slots come back after
  ``lease_s``.
- **budgets** (money per calendar month): a counter of nano-dollars spent; it refuses once it
  has reached the limit, and a finished request adds its cost.

``admit`` checks every counter of a request and changes them only if all pass: all or nothing,
atomically (the Redis store runs it as one Lua script, one round trip). Of several refusals it
reports the one that lasts longest, since that is what the client must wait for. ``settle`` is
the end of a request: token reservations corrected to the actual count, its slots released,
its cost charged. ``send_settle`` is the same without waiting for the store's answer: it returns
once the settlement is on its way ahead of anything the client can do after its response (the
limiter calls it before a response's last bytes), with the outcome in a task.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

# A refusal waits at least this long: a retry any sooner would be refused again.
MIN_WAIT_S = 1e-6
# A slot frees when some request ends, which nobody can predict: the Retry-After of a full one.
SLOT_RETRY_S = 1.0
# Times are seconds since the epoch (Redis's clock): a double resolves them to ~0.2 µs, so
# comparisons allow a microsecond (the same one when admitting and when counting what is left).
_EPSILON_S = 1e-6


class LimitStoreError(Exception):
    """The store cannot be reached or answered nonsense (the limiter fails open or closed on it)."""


@dataclass(frozen=True, slots=True)
class RateCheck:
    key: str
    limit: int   # units per period
    cost: int    # units this request takes now (at most ``limit``)


@dataclass(frozen=True, slots=True)
class SlotCheck:
    key: str
    limit: int   # leases at once


@dataclass(frozen=True, slots=True)
class BudgetCheck:
    key: str
    limit: int          # nano-dollars per budget period
    period_left_s: float  # until this budget period ends: the wait when it is spent


@dataclass(frozen=True, slots=True)
class Checks:
    """One request's admission: every counter it must pass, and the id of its lease."""

    rates: tuple[RateCheck, ...] = ()
    slots: tuple[SlotCheck, ...] = ()
    budgets: tuple[BudgetCheck, ...] = ()
    lease_id: str = ""


@dataclass(frozen=True, slots=True)
class RateState:
    remaining: int   # units the bucket holds
    reset_s: float   # until it is full again


@dataclass(frozen=True, slots=True)
class Verdict:
    """``refused``: index into rates + slots + budgets of the binding refusal, None when admitted.
    ``rates``: every rate's state after the admission (before it, when refused)."""

    refused: int | None
    retry_after_s: float
    rates: tuple[RateState, ...]


@dataclass(frozen=True, slots=True)
class Settlement:
    """The end of a request: ``rates`` (key, limit, units to add, negative to give back), the
    ``slots`` to release ``lease_id`` from, ``budgets`` (key, nano-dollars spent, seconds to keep)."""

    rates: tuple[tuple[str, int, int], ...] = ()
    slots: tuple[str, ...] = ()
    budgets: tuple[tuple[str, int, float], ...] = ()
    lease_id: str = ""


class LimitStore(Protocol):
    """Counters shared by every gateway that uses the same store. Methods raise ``LimitStoreError``."""

    async def admit(self, checks: Checks) -> Verdict: ...

    async def settle(self, settlement: Settlement) -> None: ...

    async def send_settle(self, settlement: Settlement) -> Awaitable[None]:
        """Send ``settlement``; on return any later call sees it. The awaitable is its outcome."""
        ...

    async def peek(self, rates: Sequence[RateCheck]) -> tuple[RateState, ...]:
        """The state of ``rates`` (costs ignored), changing nothing."""
        ...

    async def seed_budget(self, key: str, spent_nusd: int, keep_s: float) -> None:
        """Raise the budget counter ``key`` to at least ``spent_nusd`` (what the ledger says was spent)."""
        ...

    async def renew(self, leases: Sequence[tuple[str, str]]) -> None:
        """Extend the (slot key, lease id) leases by ``lease_s`` from now; gone ones stay gone."""
        ...

    async def ping(self) -> None:
        """Return once the store answers (``LimitStoreError`` when it does not)."""
        ...

    async def close(self) -> None: ...


def rate_state(tat: float, now: float, limit: int, period_s: float) -> RateState:
    """What a bucket whose theoretical arrival time is ``tat`` holds at ``now``."""
    interval = period_s / limit
    tat = max(tat, now)
    remaining = math.floor((now + period_s - tat + _EPSILON_S) / interval)
    return RateState(max(0, min(limit, remaining)), tat - now)


def gcra(tat: float, now: float, limit: int, cost: int, period_s: float) -> tuple[float, float]:
    """(the new ``tat`` if ``cost`` units pass now, the wait before they would: 0 if they pass)."""
    new = max(tat, now) + cost * period_s / limit
    wait = new - period_s - now
    return new, (wait if wait > _EPSILON_S else 0.0)


class MemoryLimitStore:
    """The store of a lone gateway: dicts in this process, the same semantics as Redis's.

    Methods never await, so each is atomic on the event loop. Empty counters (full buckets,
    expired leases and budgets) are swept once a period so the dicts stay small.
    """

    def __init__(self, period_s: float, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self.lease_s = lease_s
        self._clock = clock
        self._tats: dict[str, float] = {}
        self._slots: dict[str, dict[str, float]] = {}  # key -> lease id -> expiry
        self._spent: dict[str, tuple[int, float]] = {}  # key -> (nano-dollars, expiry)
        self._swept = clock()

    async def admit(self, checks: Checks) -> Verdict:
        now = self._clock()
        self._sweep(now)
        refused, longest = None, 0.0
        tats = []
        for i, rate in enumerate(checks.rates):
            tat, wait = gcra(self._tats.get(rate.key, now), now, rate.limit, rate.cost, self.period_s)
            tats.append(tat)
            if wait > longest:
                refused, longest = i, wait
        base = len(checks.rates)
        for j, slot in enumerate(checks.slots):
            if len(self._live_leases(slot.key, now)) >= slot.limit and SLOT_RETRY_S > longest:
                refused, longest = base + j, SLOT_RETRY_S
        base += len(checks.slots)
        for k, budget in enumerate(checks.budgets):
            wait = max(budget.period_left_s, MIN_WAIT_S)
            if self._spent_now(budget.key, now) >= budget.limit and wait > longest:
                refused, longest = base + k, wait
        if refused is None:
            for rate, tat in zip(checks.rates, tats):
                self._tats[rate.key] = tat
            for slot in checks.slots:
                self._slots.setdefault(slot.key, {})[checks.lease_id] = now + self.lease_s
        states = tuple(rate_state(self._tats.get(r.key, now), now, r.limit, self.period_s) for r in checks.rates)
        return Verdict(refused, longest, states)

    async def settle(self, settlement: Settlement) -> None:
        now = self._clock()
        for key, limit, delta in settlement.rates:
            if delta:
                tat = max(self._tats.get(key, now), now) + delta * self.period_s / limit
                self._tats[key] = max(tat, now)
        for key in settlement.slots:
            self._slots.get(key, {}).pop(settlement.lease_id, None)
        for key, nusd, keep_s in settlement.budgets:
            self._spent[key] = (self._spent_now(key, now) + nusd, now + keep_s)

    async def send_settle(self, settlement: Settlement) -> Awaitable[None]:
        await self.settle(settlement)  # applied at once: nothing to wait for
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def seed_budget(self, key: str, spent_nusd: int, keep_s: float) -> None:
        now = self._clock()
        if spent_nusd > self._spent_now(key, now):
            self._spent[key] = (spent_nusd, now + keep_s)

    async def peek(self, rates: Sequence[RateCheck]) -> tuple[RateState, ...]:
        now = self._clock()
        return tuple(rate_state(self._tats.get(r.key, now), now, r.limit, self.period_s) for r in rates)

    async def renew(self, leases: Sequence[tuple[str, str]]) -> None:
        expiry = self._clock() + self.lease_s
        for key, lease_id in leases:
            held = self._slots.get(key)
            if held is not None and lease_id in held:
                held[lease_id] = expiry

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def _live_leases(self, key: str, now: float) -> dict[str, float]:
        held = self._slots.get(key, {})
        for lease_id in [lease for lease, expiry in held.items() if expiry <= now]:
            del held[lease_id]
        return held

    def _spent_now(self, key: str, now: float) -> int:
        spent, expiry = self._spent.get(key, (0, now))
        return spent if expiry > now else 0

    def _sweep(self, now: float) -> None:
        if now - self._swept < self.period_s:
            return
        self._swept = now
        self._tats = {k: tat for k, tat in self._tats.items() if tat > now}
        self._slots = {k: held for k in list(self._slots) if (held := self._live_leases(k, now))}
        self._spent = {k: v for k, v in self._spent.items() if v[1] > now}
