"""The kvstore is a cache: losing it must cost nothing but cache hits.

Streams are open when the kvstore is signalled, and more start right after (their prefill finds
no kvstore). Every stream must complete with the text of an uninterrupted run, and ``crescent up``
must bring the kvstore back.
"""

from __future__ import annotations

import signal

import pytest

from tests.faults.load import story_prompts
from tests.faults.scenarios import STALL_LIMIT_S, STREAMS, streams_under_fault

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

PROMPTS = story_prompts(STREAMS + 2)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
async def test_streams_complete_unchanged_and_the_kvstore_comes_back(healthy_stack, client, sig):
    outcome = await streams_under_fault(healthy_stack, client, f"kvstore {sig.name}", "kvstore", sig,
                                        prompts=PROMPTS[:STREAMS], late_prompts=PROMPTS[STREAMS:])
    assert outcome.incomplete() == []
    assert outcome.mismatched() == []
    assert outcome.worst_stall_s() <= STALL_LIMIT_S
    assert outcome.recovery_error is None
