"""The gateway's own faults, and clients that leave.

SIGTERM drains: in-flight streams complete (the suite's grace, ``StackPlan.drain_grace_s``, covers them) while
/health says 503. SIGKILL breaks the open connections (nothing can carry them), and decode frees
their KV within 1 s; so it does when clients hang up, mid-stream or before their first token.
"""

from __future__ import annotations

import signal

import pytest

from tests.faults.kv_scenarios import clients_gone, gateway_killed
from tests.faults.load import story_prompts
from tests.faults.scenarios import STALL_LIMIT_S, STREAMS, streams_under_fault

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

KV_FREED_LIMIT_S = 1.0


async def test_in_flight_streams_complete_when_the_gateway_drains(healthy_stack, client):
    outcome = await streams_under_fault(healthy_stack, client, "gateway SIGTERM", "gateway", signal.SIGTERM,
                                        prompts=story_prompts(STREAMS), watch_target_health=True)
    assert 503 in outcome.target_health[:10], "a draining gateway must turn unready at once"
    assert outcome.incomplete() == []
    assert outcome.mismatched() == []
    assert outcome.worst_stall_s() <= STALL_LIMIT_S
    assert outcome.recovery_error is None


async def test_killed_gateway_breaks_its_streams_and_decode_frees_their_kv(healthy_stack, client):
    outcome = await gateway_killed(healthy_stack, client)
    broken = [r for r in outcome.streams if not r.completed]
    assert broken, "streams were open when the gateway died"
    assert all(r.transport_error for r in broken), [r.describe() for r in broken]
    assert outcome.kv_at_fault > 0, "decode held the streams' KV when the gateway died"
    assert outcome.kv_freed_s is not None and outcome.kv_freed_s <= KV_FREED_LIMIT_S, outcome.kv_freed_s
    assert outcome.recovery_error is None


@pytest.mark.parametrize("before_first_token", [False, True], ids=["mid-stream", "before-first-token"])
async def test_decode_frees_the_kv_of_clients_that_hang_up(healthy_stack, client, before_first_token):
    outcome = await clients_gone(healthy_stack, client, before_first_token=before_first_token)
    if not before_first_token:
        assert outcome.kv_at_fault > 0, "decode held the streams' KV when the clients left"
    assert outcome.kv_freed_s is not None and outcome.kv_freed_s <= KV_FREED_LIMIT_S, outcome.kv_freed_s
