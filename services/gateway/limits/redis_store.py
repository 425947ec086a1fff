"""The ``LimitStore`` every gateway of a deployment shares: Redis, one Lua script per call.

Each call is one script (``EVALSHA``, one round trip), so a check-and-take is atomic across
gateways, and times come from Redis's own clock (``TIME``), so gateways with skewed clocks
still agree. The semantics are ``limit_store``'s; the scripts mirror ``MemoryLimitStore``
line for line. Counters expire by themselves (a full bucket, a lease, a past month's spend),
so Redis holds only what is in use.

Any Redis failure (refused connection, timeout, script error) raises ``LimitStoreError``; the
client does not retry, the limiter decides (``limits.on_store_error``).

``send_settle`` writes the settle script's call on the pipe (``limit_pipe.py``: one connection
for calls not waited for) and returns: the bytes are in Redis's socket before the gateway sends
the response's last bytes, so Redis runs the settle before any request the client sends after
reading them. A task reads the answer. This takes a round trip off every response (on an idle VM
a round trip costs ~0.5 ms of wake-ups). Admissions far from every limit go the same way,
answered from the gateway's view of Redis (``limit_view.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from crescent.services.gateway.limits.store import (
    SLOT_RETRY_S,
    Checks,
    LimitStoreError,
    RateCheck,
    RateState,
    Settlement,
    Verdict,
)
from crescent.services.gateway.limits.pipe import RedisPipe
from crescent.services.gateway.limits.view import LimitView

_NOW = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) + tonumber(t[2]) / 1000000\n"
_STATE = """
local function state(tat, limit, period)
  local remaining = math.floor((now + period - tat + 1e-6) / (period / limit))
  return math.max(0, math.min(limit, remaining)), string.format('%.6f', tat - now)
end
"""

# KEYS: rate keys, slot keys, budget keys. ARGV: #rates, #slots, #budgets, period_s, lease_s,
# lease id, force (1: take even if refused: a gateway admitted it from its view), then (limit,
# cost) per rate, limit per slot, (limit, period_left_s) per budget. Returns the refusal, then
# (remaining, reset) per rate, leases held per slot, nano-dollars spent per budget.
ADMIT = _NOW + _STATE + f"""
local nr, ns, nb = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local period, lease_s, lease, force = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], ARGV[7] == '1'
local a = 8
local refused, longest = 0, 0
local limits, tats, news = {{}}, {{}}, {{}}
for i = 1, nr do
  local limit, cost = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  a = a + 2
  local v = redis.call('GET', KEYS[i])
  local tat = math.max(v and tonumber(v) or now, now)
  local new = tat + cost * period / limit
  local wait = new - period - now
  if wait > 1e-6 and wait > longest then refused, longest = i, wait end
  limits[i], tats[i], news[i] = limit, tat, new
end
for j = 1, ns do
  local key, limit = KEYS[nr + j], tonumber(ARGV[a])
  a = a + 1
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('ZCARD', key) >= limit and {SLOT_RETRY_S} > longest then refused, longest = nr + j, {SLOT_RETRY_S} end
end
for k = 1, nb do
  local key, limit, wait = KEYS[nr + ns + k], tonumber(ARGV[a]), math.max(tonumber(ARGV[a + 1]), 1e-6)
  a = a + 2
  local v = redis.call('GET', key)
  if (v and tonumber(v) or 0) >= limit and wait > longest then refused, longest = nr + ns + k, wait end
end
if refused == 0 or force then
  for i = 1, nr do
    tats[i] = news[i]
    redis.call('SET', KEYS[i], string.format('%.6f', news[i]), 'PX', math.ceil((news[i] - now) * 1000) + 1000)
  end
  for j = 1, ns do
    redis.call('ZADD', KEYS[nr + j], now + lease_s, lease)
    redis.call('PEXPIRE', KEYS[nr + j], math.ceil(lease_s * 1000) + 1000)
  end
end
local out = {{refused, string.format('%.6f', longest)}}
for i = 1, nr do
  local remaining, reset = state(tats[i], limits[i], period)
  out[#out + 1] = remaining
  out[#out + 1] = reset
end
for j = 1, ns do
  out[#out + 1] = redis.call('ZCARD', KEYS[nr + j])
end
for k = 1, nb do
  out[#out + 1] = tonumber(redis.call('GET', KEYS[nr + ns + k]) or '0')
end
return out
"""

# KEYS: rate keys, slot keys, budget keys. ARGV: #rates, #slots, #budgets, period_s, lease id,
# then (limit, delta) per rate, (nano-dollars, keep_s) per budget.
SETTLE = _NOW + """
local nr, ns, nb = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local period, lease = tonumber(ARGV[4]), ARGV[5]
local a = 6
for i = 1, nr do
  local limit, delta = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  a = a + 2
  local v = redis.call('GET', KEYS[i])
  local tat = math.max(v and tonumber(v) or now, now) + delta * period / limit
  if tat > now then
    redis.call('SET', KEYS[i], string.format('%.6f', tat), 'PX', math.ceil((tat - now) * 1000) + 1000)
  else
    redis.call('DEL', KEYS[i])
  end
end
for j = 1, ns do
  redis.call('ZREM', KEYS[nr + j], lease)
end
for k = 1, nb do
  local key = KEYS[nr + ns + k]
  redis.call('INCRBY', key, ARGV[a])
  redis.call('EXPIRE', key, math.ceil(tonumber(ARGV[a + 1])))
  a = a + 2
end
return 1
"""

# KEYS: the budget key. ARGV: nano-dollars the ledger counts, seconds to keep.
SEED = """
local spent = tonumber(redis.call('GET', KEYS[1]) or '0')
if spent < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', math.ceil(tonumber(ARGV[2])))
end
return 1
"""

# KEYS: rate keys. ARGV: period_s, then the limit per rate.
PEEK = _NOW + _STATE + """
local period = tonumber(ARGV[1])
local out = {}
for i = 1, #KEYS do
  local v = redis.call('GET', KEYS[i])
  local remaining, reset = state(math.max(v and tonumber(v) or now, now), tonumber(ARGV[i + 1]), period)
  out[#out + 1] = remaining
  out[#out + 1] = reset
end
return out
"""

# KEYS: slot keys. ARGV: lease_s, then the lease id per key.
RENEW = _NOW + """
local lease_s = tonumber(ARGV[1])
for i = 1, #KEYS do
  if redis.call('ZADD', KEYS[i], 'XX', 'CH', now + lease_s, ARGV[i + 1]) == 1 then
    redis.call('PEXPIRE', KEYS[i], math.ceil(lease_s * 1000) + 1000)
  end
end
return 1
"""


def _admit_call(checks: Checks, period_s: float, lease_s: float, *, force: bool) -> tuple[list[str], list[object]]:
    """The ADMIT script's keys and arguments."""
    keys = [r.key for r in checks.rates] + [s.key for s in checks.slots] + [b.key for b in checks.budgets]
    args: list[object] = [len(checks.rates), len(checks.slots), len(checks.budgets), period_s, lease_s,
                          checks.lease_id, 1 if force else 0]
    for rate in checks.rates:
        args += [rate.limit, rate.cost]
    args += [slot.limit for slot in checks.slots]
    for budget in checks.budgets:
        args += [budget.limit, budget.period_left_s]
    return keys, args


def _settle_call(settlement: Settlement, period_s: float) -> tuple[list[str], list[object]]:
    """The SETTLE script's keys and arguments."""
    keys = [k for k, _, _ in settlement.rates] + list(settlement.slots) + [k for k, _, _ in settlement.budgets]
    args: list[object] = [len(settlement.rates), len(settlement.slots), len(settlement.budgets), period_s,
                          settlement.lease_id]
    for _, limit, delta in settlement.rates:
        args += [limit, delta]
    for _, nusd, keep_s in settlement.budgets:
        args += [nusd, keep_s]
    return keys, args


def _states(flat: Sequence[object]) -> tuple[RateState, ...]:
    return tuple(RateState(int(flat[i]), float(flat[i + 1])) for i in range(0, len(flat), 2))  # type: ignore[arg-type]


class RedisLimitStore:
    """``LimitStore`` on a Redis server at ``url`` (``redis://``, ``rediss://`` or ``unix://``)."""

    def __init__(self, url: str, period_s: float, lease_s: float, timeout_s: float, *, fast_admit: bool = True) -> None:
        self.period_s = period_s
        self.lease_s = lease_s
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        self._admit = self._redis.register_script(ADMIT)
        self._settle = self._redis.register_script(SETTLE)
        self._peek = self._redis.register_script(PEEK)
        self._renew = self._redis.register_script(RENEW)
        self._seed = self._redis.register_script(SEED)
        self.view = LimitView(period_s) if fast_admit else LimitView(period_s, max_age_s=-1.0)
        self.on_background_error: Callable[[LimitStoreError], None] | None = None
        self._answers: set[asyncio.Task[None]] = set()
        self._pipe = RedisPipe(self._redis.connection_pool)

    async def _call(self, script: AsyncScript, keys: list[str], args: list[object]) -> object:
        try:
            return await script(keys=keys, args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            raise LimitStoreError(f"{exc.__class__.__name__}: {exc}") from exc

    async def admit(self, checks: Checks) -> Verdict:
        seq = self.view.next_seq()
        taken = self.view.take(checks, seq)
        keys, args = _admit_call(checks, self.period_s, self.lease_s, force=taken is not None)
        if taken is not None:  # far from every limit: counted in Redis, its answer not waited for
            await self._send(self._admit, keys, args, lambda reply: self._learn(checks, seq, reply))
            return Verdict(None, 0.0, taken)
        return self._learn(checks, seq, await self._call(self._admit, keys, args))

    def _learn(self, checks: Checks, seq: int, reply: object) -> Verdict:
        refused, longest, *flat = reply  # type: ignore[misc]
        nr, ns = 2 * len(checks.rates), len(checks.slots)
        rates = _states(flat[:nr])
        self.view.learn(checks, seq, rates, tuple(int(n) for n in flat[nr: nr + ns]),
                        tuple(int(n) for n in flat[nr + ns:]))
        return Verdict(int(refused) - 1 if int(refused) else None, float(longest), rates)

    async def settle(self, settlement: Settlement) -> None:
        self.view.settled(settlement.slots, settlement.budgets)
        await self._call(self._settle, *_settle_call(settlement, self.period_s))

    async def send_settle(self, settlement: Settlement) -> Awaitable[None]:
        self.view.settled(settlement.slots, settlement.budgets)
        return await self._send(self._settle, *_settle_call(settlement, self.period_s))

    async def _send(self, script: AsyncScript, keys: list[str], args: list[object],
                    on_reply: Callable[[object], object] | None = None) -> asyncio.Task[None]:
        """Write a script's call on the pipe and return: Redis has it ahead of anything sent after.
        A task takes the answer (``on_reply``); it raises ``LimitStoreError``."""
        try:
            answer = await self._pipe.send("EVALSHA", script.sha, len(keys), *keys, *args)
        except (RedisError, OSError, TimeoutError) as exc:
            self.view.forget()
            raise LimitStoreError(f"{exc.__class__.__name__}: {exc}") from exc
        task = asyncio.get_running_loop().create_task(self._answer(answer, script, keys, args, on_reply))
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)
        return task

    async def _answer(self, answer: asyncio.Future[object], script: AsyncScript, keys: list[str],
                      args: list[object], on_reply: Callable[[object], object] | None) -> None:
        """The answer of a sent call; a Redis that lost its scripts (restarted) gets it again, loaded."""
        try:
            try:
                reply = await answer
            except NoScriptError:
                reply = await self._call(script, keys, args)
            except (RedisError, OSError, TimeoutError) as exc:
                raise LimitStoreError(f"{exc.__class__.__name__}: {exc}") from exc
            if on_reply is not None:
                on_reply(reply)
        except LimitStoreError as exc:
            self.view.forget()
            if self.on_background_error is not None and on_reply is not None:  # a settle's caller hears it itself
                self.on_background_error(exc)
                return
            raise

    async def peek(self, rates: Sequence[RateCheck]) -> tuple[RateState, ...]:
        reply = await self._call(self._peek, [r.key for r in rates], [self.period_s, *(r.limit for r in rates)])
        return _states(reply)  # type: ignore[arg-type]

    async def seed_budget(self, key: str, spent_nusd: int, keep_s: float) -> None:
        await self._call(self._seed, [key], [spent_nusd, keep_s])

    async def renew(self, leases: Sequence[tuple[str, str]]) -> None:
        if leases:
            await self._call(self._renew, [k for k, _ in leases], [self.lease_s, *(lease for _, lease in leases)])

    async def ping(self) -> None:
        try:
            await self._redis.ping()
        except (RedisError, OSError, TimeoutError) as exc:
            raise LimitStoreError(f"{exc.__class__.__name__}: {exc}") from exc

    async def close(self) -> None:
        await asyncio.gather(*self._answers, return_exceptions=True)
        await self._pipe.close()
        await self._redis.aclose()
