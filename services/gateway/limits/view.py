"""What one gateway last heard from Redis about each counter: admission without a round trip
while a request is far from every limit.

Every Redis admission answers with the state of the counters it touched (what each bucket
holds, the leases held, the money spent). A request whose counters were all heard of within
``max_age_s`` and that leaves each more than ``margin`` of its limit away is admitted from this
view: the admission is still sent to Redis (and counted there, whatever it says), but its answer
is not waited for; it refreshes the view when it comes. Near a limit, or with nothing recent,
the limiter waits for Redis as before, so limits hold where they bind. What other gateways took
since the last answer is unseen; the margin (10% of a limit by default, at least one request,
plus as much again as this gateway has in flight unanswered) covers it. On a VM whose cores idle between requests a round trip to Redis is ~0.5-1.5 ms of
wake-ups, most of the added latency of limits; this takes it off the request path.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from crescent.services.gateway.limits.store import Checks, RateState


@dataclass(slots=True)
class _Heard:
    value: float = 0.0  # rates: units the bucket held; slots: leases held; budgets: nano-dollars spent
    at: float = -math.inf  # monotonic time it was last heard or estimated
    seq: int = -1  # the admission whose answer it was: an older answer arriving late is ignored
    pending: dict[int, float] = field(default_factory=dict)  # taken here, Redis's answer not heard yet


class LimitView:
    def __init__(self, period_s: float, *, max_age_s: float = 1.0, margin: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self.max_age_s = max_age_s
        self.margin = margin
        self._clock = clock
        self._seq = 0
        self._rates: dict[str, _Heard] = {}
        self._slots: dict[str, _Heard] = {}
        self._budgets: dict[str, _Heard] = {}

    def _fresh(self, table: dict[str, _Heard], key: str, now: float) -> _Heard | None:
        heard = table.get(key)
        return heard if heard is not None and now - heard.at <= self.max_age_s else None

    def next_seq(self) -> int:
        """The number of an admission about to be sent (answers are applied in this order)."""
        self._seq += 1
        return self._seq

    def take(self, checks: Checks, seq: int) -> tuple[RateState, ...] | None:
        """If every counter of ``checks`` is recent and far from its limit: take the request's share
        from the view and return the rates' states after it (the headers); otherwise None."""
        now = self._clock()
        rates = []
        for rate in checks.rates:
            heard = self._fresh(self._rates, rate.key, now)
            if heard is None:
                return None
            held = min(rate.limit, heard.value + (now - heard.at) * rate.limit / self.period_s)  # refilled since
            # Room for the margin and, again, for what this gateway has in flight: other gateways
            # under the same load have about as much in flight that this view has not seen.
            if held - rate.cost < max(self.margin * rate.limit, rate.cost) + sum(heard.pending.values()):
                return None
            rates.append((heard, held))
        for slot in checks.slots:
            heard = self._fresh(self._slots, slot.key, now)
            if heard is None or heard.value + 1 + len(heard.pending) > slot.limit - max(1.0, self.margin * slot.limit):
                return None
        for budget in checks.budgets:
            heard = self._fresh(self._budgets, budget.key, now)
            if heard is None or heard.value >= (1 - self.margin) * budget.limit:
                return None
        states = []
        for rate, (heard, held) in zip(checks.rates, rates):
            heard.value, heard.at = held - rate.cost, now
            heard.pending[seq] = rate.cost
            states.append(RateState(math.floor(heard.value), (rate.limit - heard.value) * self.period_s / rate.limit))
        for slot in checks.slots:
            heard = self._slots[slot.key]
            heard.value += 1
            heard.pending[seq] = 1
        return tuple(states)

    def learn(self, checks: Checks, seq: int, rates: tuple[RateState, ...], slots: tuple[int, ...],
              spent: tuple[int, ...]) -> None:
        """Redis's answer to admission ``seq`` of ``checks``: the counters as they stood after it;
        what this gateway took since (sent after it, not answered yet) still counts."""
        now = self._clock()
        for table, keys, values, sign in ((self._rates, [r.key for r in checks.rates], [r.remaining for r in rates], -1),
                                          (self._slots, [c.key for c in checks.slots], list(slots), 1),
                                          (self._budgets, [b.key for b in checks.budgets], list(spent), 1)):
            for key, value in zip(keys, values):
                heard = table.setdefault(key, _Heard())
                heard.pending.pop(seq, None)
                if seq < heard.seq:
                    continue  # a later answer is already in
                later = sum(cost for s, cost in heard.pending.items() if s > seq)
                heard.value, heard.at, heard.seq = float(value) + sign * later, now, seq

    def settled(self, slots: tuple[str, ...], budgets: tuple[tuple[str, int, float], ...]) -> None:
        """A request ended here: its leases are free, its cost is spent (until Redis says more)."""
        for key in slots:
            if (heard := self._slots.get(key)) is not None:
                heard.value = max(0.0, heard.value - 1)
        for key, nusd, _ in budgets:
            if (heard := self._budgets.get(key)) is not None:
                heard.value += nusd

    def forget(self) -> None:
        """After a store error: nothing heard before it is trusted."""
        self._rates.clear()
        self._slots.clear()
        self._budgets.clear()
