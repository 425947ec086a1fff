"""The rate-limit stores' contract, run against both: the in-process store and a real redis-server."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from crescent.services.gateway.limits.redis_store import RedisLimitStore
from crescent.services.gateway.limits.store import (
    BudgetCheck,
    Checks,
    LimitStore,
    LimitStoreError,
    MemoryLimitStore,
    RateCheck,
    Settlement,
    SlotCheck,
)
from tests.ports import free_port
from tests.tenancy.redis_server import RedisServer, redis_server

pytestmark = pytest.mark.asyncio(loop_scope="session")

StoreFactory = Callable[..., LimitStore]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.slow)])  # redis: a server process
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    made: list[LimitStore] = []

    def make(period_s: float = 1.0, lease_s: float = 30.0) -> LimitStore:
        if request.param == "memory":
            store: LimitStore = MemoryLimitStore(period_s, lease_s)
        else:
            store = RedisLimitStore(request.getfixturevalue("redis").url, period_s, lease_s, timeout_s=2.0)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


def key(name: str) -> str:
    return f"test:{uuid.uuid4().hex}:{name}"


async def test_a_bucket_holds_its_limit_then_refills_at_the_limit_rate(make_store: StoreFactory) -> None:
    store, rpm = make_store(period_s=1.0), key("rpm")
    verdicts = [await store.admit(Checks(rates=(RateCheck(rpm, 5, 1),))) for _ in range(6)]
    assert [v.refused for v in verdicts] == [None] * 5 + [0]
    assert [v.rates[0].remaining for v in verdicts] == [4, 3, 2, 1, 0, 0]
    assert verdicts[0].rates[0].reset_s == pytest.approx(0.2, abs=0.01), "one request refills in period / limit"
    assert 0.1 < verdicts[5].retry_after_s <= 0.201
    await asyncio.sleep(verdicts[5].retry_after_s + 0.01)
    again = await store.admit(Checks(rates=(RateCheck(rpm, 5, 1),)))
    assert again.refused is None and again.rates[0].remaining == 0


async def test_admission_is_all_or_nothing_and_names_the_longest_wait(make_store: StoreFactory) -> None:
    store = make_store(period_s=10.0)
    roomy, tight, budget = key("roomy"), key("tight"), key("spend")
    assert (await store.admit(Checks(rates=(RateCheck(tight, 10, 10),)))).refused is None
    await store.settle(Settlement(budgets=((budget, 500, 60.0),)))
    both = Checks(rates=(RateCheck(roomy, 100, 1), RateCheck(tight, 10, 1)),
                  budgets=(BudgetCheck(budget, 1000, 3600.0),))
    refused = await store.admit(both)
    assert refused.refused == 1 and 0.9 < refused.retry_after_s <= 1.0, "the tight bucket: 1 token per second"
    assert (await store.peek([RateCheck(roomy, 100, 0)]))[0].remaining == 100, "nothing taken from the roomy one"
    await store.settle(Settlement(budgets=((budget, 500, 60.0),)))  # now 1000 of 1000 spent
    spent = await store.admit(both)
    assert spent.refused == 2 and spent.retry_after_s == pytest.approx(3600.0), "the budget lasts longest"


async def test_tokens_settle_to_the_actual_count(make_store: StoreFactory) -> None:
    store, tpm = make_store(period_s=60.0), key("tpm")
    reserved = await store.admit(Checks(rates=(RateCheck(tpm, 1000, 800),)))
    assert reserved.rates[0].remaining == 200
    assert (await store.admit(Checks(rates=(RateCheck(tpm, 1000, 300),)))).refused == 0
    await store.settle(Settlement(rates=((tpm, 1000, -700),)))  # used 100 of the 800
    assert (await store.peek([RateCheck(tpm, 1000, 0)]))[0].remaining == 900
    await store.settle(Settlement(rates=((tpm, 1000, 1500),)))  # a request that used far more than it said
    state = (await store.peek([RateCheck(tpm, 1000, 0)]))[0]
    assert state.remaining == 0 and 95 < state.reset_s <= 96, "1600 tokens taken: the debt is paid off first"


async def test_slots_are_held_until_released(make_store: StoreFactory) -> None:
    store, slots = make_store(), key("concurrent")
    admitted = [await store.admit(Checks(slots=(SlotCheck(slots, 2),), lease_id=f"l{i}")) for i in range(3)]
    assert [v.refused for v in admitted] == [None, None, 0]
    assert admitted[2].retry_after_s == 1.0
    await store.settle(Settlement(slots=(slots,), lease_id="l0"))
    assert (await store.admit(Checks(slots=(SlotCheck(slots, 2),), lease_id="l3"))).refused is None


async def test_a_lease_nobody_renews_runs_out(make_store: StoreFactory) -> None:
    """A gateway killed with -9 never releases its slots: they come back after ``lease_s``."""
    store, kept, dropped = make_store(lease_s=0.4), key("kept"), key("dropped")
    for slots in (kept, dropped):
        assert (await store.admit(Checks(slots=(SlotCheck(slots, 1),), lease_id="first"))).refused is None
    await asyncio.sleep(0.25)
    await store.renew([(kept, "first")])
    await asyncio.sleep(0.25)
    assert (await store.admit(Checks(slots=(SlotCheck(kept, 1),), lease_id="second"))).refused == 0, "renewed"
    assert (await store.admit(Checks(slots=(SlotCheck(dropped, 1),), lease_id="second"))).refused is None


async def test_a_spent_budget_refuses_until_its_period_ends(make_store: StoreFactory) -> None:
    store, spend = make_store(), key("spend")
    check = Checks(budgets=(BudgetCheck(spend, 1_000_000, 42.0),))
    assert (await store.admit(check)).refused is None
    await store.settle(Settlement(budgets=((spend, 999_999, 60.0),)))
    assert (await store.admit(check)).refused is None, "refused once spent, not before"
    await store.settle(Settlement(budgets=((spend, 1, 60.0),)))
    refused = await store.admit(check)
    assert refused.refused == 0 and refused.retry_after_s == pytest.approx(42.0)


async def test_an_unreachable_redis_fails_fast() -> None:
    store = RedisLimitStore(f"redis://127.0.0.1:{free_port()}/0", 60.0, 30.0, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(LimitStoreError):
        await store.admit(Checks(rates=(RateCheck("x", 1, 1),)))
    assert time.monotonic() - started < 0.5
    await store.close()


async def test_a_sent_settle_is_seen_by_the_next_admission_from_another_gateway(make_store: StoreFactory) -> None:
    """``send_settle`` returns before the store answers (the gateway then sends the response's last
    bytes): a client's next request, admitted by another gateway on its own connection, must still
    find the slot free. 200 times, with the slot's limit at one."""
    ending, other = make_store(), make_store()
    slots, outcomes = key("concurrent"), []
    for i in range(200):
        assert (await ending.admit(Checks(slots=(SlotCheck(slots, 1),), lease_id=f"l{i}"))).refused is None
        outcomes.append(await ending.send_settle(Settlement(slots=(slots,), lease_id=f"l{i}")))
        assert (await other.admit(Checks(slots=(SlotCheck(slots, 1),), lease_id=f"o{i}"))).refused is None
        await other.settle(Settlement(slots=(slots,), lease_id=f"o{i}"))
    await asyncio.gather(*outcomes)


@pytest.mark.slow
async def test_a_sent_settle_survives_a_redis_that_lost_its_scripts(redis: RedisServer) -> None:
    """A restarted Redis has no scripts loaded: the settle is run again with its script."""
    store, spend = RedisLimitStore(redis.url, 60.0, 30.0, timeout_s=2.0), key("spend")
    check = Checks(budgets=(BudgetCheck(spend, 10, 42.0),))
    await store.admit(check)
    await store._redis.script_flush()
    await (await store.send_settle(Settlement(budgets=((spend, 10, 60.0),))))
    assert (await store.admit(check)).refused == 0, "the spend was charged"
    await store.close()


async def test_a_sent_settle_to_an_unreachable_redis_raises_the_store_error() -> None:
    store = RedisLimitStore(f"redis://127.0.0.1:{free_port()}/0", 60.0, 30.0, timeout_s=0.5)
    with pytest.raises(LimitStoreError):
        await store.send_settle(Settlement(slots=("x",), lease_id="l"))
    await store.close()


async def test_seeding_a_budget_raises_it_never_lowers_it(make_store: StoreFactory) -> None:
    store, spend = make_store(), key("spend")
    check = Checks(budgets=(BudgetCheck(spend, 100, 42.0),))
    await store.seed_budget(spend, 99, 60.0)
    assert (await store.admit(check)).refused is None
    await store.seed_budget(spend, 100, 60.0)
    assert (await store.admit(check)).refused == 0, "raised to what the ledger counts"
    await store.seed_budget(spend, 5, 60.0)
    assert (await store.admit(check)).refused == 0, "a smaller sum (rows not yet committed) lowers nothing"


@pytest.mark.slow
async def test_two_gateways_admitting_from_their_views_hold_the_limit(redis: RedisServer) -> None:
    """Most admissions far from a limit are answered from each gateway's view of Redis (no round
    trip); near the limit both wait for Redis. Two stores on one Redis, 40 concurrent callers
    each, take a bucket of 600 in a 60 s period: what passes is the bucket and its refill, within
    the 5% the limits promise across gateways (the callers loop without waiting for anything, so
    each gateway has many admissions in flight the other has not seen)."""
    stores = [RedisLimitStore(redis.url, 60.0, 30.0, timeout_s=2.0) for _ in range(2)]
    rpm, limit = key("rpm"), 600
    admitted = 0
    fast = 0
    started = time.monotonic()

    async def caller(store: RedisLimitStore) -> None:
        nonlocal admitted, fast
        while True:
            sent = store._answers.copy()
            verdict = await store.admit(Checks(rates=(RateCheck(rpm, limit, 1),)))
            if verdict.refused is not None:
                return
            admitted += 1
            fast += len(store._answers - sent) > 0

    await asyncio.gather(*(caller(store) for store in stores for _ in range(40)))
    refill = limit / 60.0 * (time.monotonic() - started)
    assert limit <= admitted <= 1.05 * (limit + refill), (admitted, refill)
    assert fast > limit / 2, f"only {fast} of {admitted} admissions skipped the round trip"
    for store in stores:
        await store.close()


async def test_a_view_too_old_or_too_near_the_limit_waits_for_redis() -> None:
    from crescent.services.gateway.limits.store import RateState
    from crescent.services.gateway.limits.view import LimitView

    now = [0.0]
    view = LimitView(60.0, max_age_s=1.0, clock=lambda: now[0])
    check = Checks(rates=(RateCheck("k", 100, 1),))
    assert view.take(check, view.next_seq()) is None, "nothing heard yet"
    view.learn(check, view.next_seq(), (RateState(50, 30.0),), (), ())
    assert view.take(check, view.next_seq()) is not None
    now[0] = 1.5
    assert view.take(check, view.next_seq()) is None, "heard too long ago"
    view.learn(check, view.next_seq(), (RateState(10, 54.0),), (), ())
    assert view.take(check, view.next_seq()) is None, "within 10% of the limit"
