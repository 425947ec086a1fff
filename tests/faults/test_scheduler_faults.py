"""The scheduler away: open streams go on, new requests get 503 + Retry-After (never a broken
connection), the gateway stays ready (/health 200), and requests succeed once it is back."""

from __future__ import annotations

import signal

import pytest

from tests.faults.scenarios import STALL_LIMIT_S, scheduler_outage

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
async def test_open_streams_finish_and_new_requests_get_503_with_retry_after(healthy_stack, client, sig):
    outcome = await scheduler_outage(healthy_stack, client, sig)
    assert outcome.incomplete() == []
    assert outcome.mismatched() == []
    assert outcome.worst_stall_s() <= STALL_LIMIT_S
    assert outcome.probes, "no request was sent while the scheduler was away"
    wrong = [p.describe() for p in outcome.probes
             if not (p.completed or (p.status == 503 and p.retry_after is not None))]
    assert wrong == [], "during the outage a request must succeed or get 503 with Retry-After"
    assert set(outcome.gateway_health) == {200}, "the gateway must stay ready while the scheduler is away"
    assert outcome.recovery_error is None  # includes: a request succeeds after the restart
