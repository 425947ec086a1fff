"""Failed authentication, throttled per source address.

Each source (the client's address: uvicorn takes it from ``X-Forwarded-For`` only when the peer
is one of ``listen.forwarded_allow_ips``) has a bucket of ``burst`` failures that refills at
``per_minute``. A source with an empty bucket gets 429 ``too_many_failed_auth`` for a key the
gateway has not seen succeed, without a database read, until the bucket refills: guessing keys
costs the guesser time and the database nothing. A key that succeeded recently is still checked
normally, so users behind the same address (a NAT, a proxy) keep working while someone there
guesses. Sources and keys are held in bounded LRU maps: a flood of addresses cannot grow them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

_MAX_SOURCES = 100_000
_MAX_GOOD_KEYS = 100_000
GOOD_KEY_S = 3600.0  # a key that succeeded within this long passes a throttled source's door


class FailedAuthThrottle:
    def __init__(self, burst: int, per_minute: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.rate_s = per_minute / 60.0
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # source -> (tokens, when)
        self._good: OrderedDict[str, float] = OrderedDict()  # key digest -> when it last succeeded

    @property
    def enabled(self) -> bool:
        return self.burst > 0

    def retry_after_s(self, source: str | None, key_digest: str) -> float:
        """0 when ``source`` may try ``key_digest`` now; else the seconds until it may."""
        if not self.enabled or source is None:
            return 0.0
        tokens = self._tokens(source)
        if tokens >= 1.0:
            return 0.0
        seen = self._good.get(key_digest)
        if seen is not None and self._clock() - seen < GOOD_KEY_S:
            return 0.0
        return (1.0 - tokens) / self.rate_s if self.rate_s > 0 else GOOD_KEY_S

    def failed(self, source: str | None) -> None:
        if not self.enabled or source is None:
            return
        self._buckets[source] = (self._tokens(source) - 1.0, self._clock())
        self._buckets.move_to_end(source)
        while len(self._buckets) > _MAX_SOURCES:
            self._buckets.popitem(last=False)

    def succeeded(self, key_digest: str) -> None:
        if not self.enabled:
            return
        self._good[key_digest] = self._clock()
        self._good.move_to_end(key_digest)
        while len(self._good) > _MAX_GOOD_KEYS:
            self._good.popitem(last=False)

    def _tokens(self, source: str) -> float:
        held = self._buckets.get(source)
        if held is None:
            return float(self.burst)
        tokens, when = held
        return min(float(self.burst), tokens + (self._clock() - when) * self.rate_s)
