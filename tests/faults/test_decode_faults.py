"""Decode dies mid-stream: its streams move to the other instance and go on with no token lost
or repeated (at temperature 0 the text equals an uninterrupted run). Decode drains on SIGTERM:
its streams run to completion where they are.

The stall bound on a kill: the client's stream breaks at once (the connection resets), but the
scheduler may place the re-prefill on the dead instance until its heartbeat timeout
(``heartbeat_timeout_s``, 3 s by default) drops it; the re-prefill of prompt + tokens so far
then takes about a second here. So no gap between two chunks may exceed the heartbeat timeout
plus 5 s.
"""

from __future__ import annotations

import signal

import pytest

from crescent.services.scheduler.config import SchedulerSettings
from tests.faults.load import story_prompts
from tests.faults.scenarios import MAX_TOKENS, STALL_LIMIT_S, STREAMS, streams_under_fault

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

HEARTBEAT_TIMEOUT_S = SchedulerSettings().heartbeat_timeout_s
MIGRATION_STALL_LIMIT_S = HEARTBEAT_TIMEOUT_S + STALL_LIMIT_S
PROMPTS = story_prompts(STREAMS + 2)


async def test_streams_migrate_with_no_token_lost_or_repeated_when_decode_is_killed(healthy_stack, client):
    outcome = await streams_under_fault(healthy_stack, client, "decode SIGKILL", None, signal.SIGKILL,
                                        role="decode", prompts=PROMPTS[:STREAMS])
    assert outcome.incomplete() == []
    assert outcome.mismatched() == []
    assert [r.completion_tokens for r in outcome.streams] == [MAX_TOKENS] * STREAMS
    assert outcome.migrations >= 1, f"{outcome.target} held streams: they must have moved"
    assert outcome.worst_stall_s() <= MIGRATION_STALL_LIMIT_S
    assert outcome.recovery_error is None


async def test_draining_decode_runs_its_streams_to_completion(healthy_stack, client):
    outcome = await streams_under_fault(healthy_stack, client, "decode SIGTERM", None, signal.SIGTERM,
                                        role="decode", prompts=PROMPTS[:STREAMS], late_prompts=PROMPTS[STREAMS:],
                                        watch_target_health=True)
    assert 503 in outcome.target_health[:10], "a draining decode must turn unready at once"
    assert outcome.incomplete() == []
    assert outcome.mismatched() == []
    assert outcome.migrations == 0, "within the grace the drain finishes streams where they are"
    assert outcome.worst_stall_s() <= STALL_LIMIT_S
    assert outcome.recovery_error is None
