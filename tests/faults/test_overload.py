"""A small decode KV cache under more requests than it holds: what is accepted is finished.

Every 200 must end with a finish_reason (zero aborted after accept); a 429 must give a true
reason (a predicted SLO miss, with the prediction); and one-token requests sent one after the
other, which never reach decode, must never be refused.
"""

from __future__ import annotations

import logging

import pytest

from tests.faults.kv_scenarios import OVERLOAD_MAX_TOKENS, OVERLOAD_REQUESTS, SEQUENTIAL_REQUESTS, overload
from tests.faults.stack import StackPlan

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

STACK_PLAN = StackPlan(kv_capacity_tokens=2048)


async def test_small_kv_overload_aborts_nothing_it_accepted(healthy_stack, client):
    outcome = await overload(healthy_stack, client)
    logging.getLogger(__name__).info("overload: concurrent %s, sequential %s, %.0f s",
                                     outcome.statuses(outcome.concurrent), outcome.statuses(outcome.sequential),
                                     outcome.seconds)
    assert len(outcome.concurrent) == OVERLOAD_REQUESTS
    prompt = max(r.prompt_tokens or 0 for r in outcome.concurrent)
    demand = OVERLOAD_REQUESTS * (prompt + OVERLOAD_MAX_TOKENS)
    capacity = STACK_PLAN.decode * STACK_PLAN.kv_capacity_tokens
    assert demand > 2 * capacity, f"not an overload: the requests need {demand} KV tokens of {capacity}"
    assert outcome.aborted_after_accept() == []
    assert set(outcome.statuses(outcome.concurrent)) <= {200, 429}
    assert outcome.untrue_429s(outcome.concurrent) == []
    assert outcome.statuses(outcome.sequential) == {200: SEQUENTIAL_REQUESTS}
