"""A prefill instance dies (or drains) while requests wait for their first token: they are
placed again elsewhere without the client noticing, and the output is what it would have been."""

from __future__ import annotations

import signal

import pytest

from tests.faults.scenarios import prefill_fault

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]


async def test_requests_before_their_first_token_are_placed_again_when_prefill_is_killed(healthy_stack, client):
    outcome = await prefill_fault(healthy_stack, client, signal.SIGKILL)
    assert outcome.waiting_at_signal >= 1, "the kill must land while requests wait for their first token"
    assert outcome.incomplete() == []
    assert outcome.mismatched() == []
    assert outcome.migrations >= 1, "the busy prefill held a request: it must have been placed again"
    assert outcome.recovery_error is None


async def test_requests_complete_when_prefill_drains(healthy_stack, client):
    outcome = await prefill_fault(healthy_stack, client, signal.SIGTERM)
    assert outcome.waiting_at_signal >= 1
    assert outcome.incomplete() == []
    assert outcome.mismatched() == []
    assert outcome.recovery_error is None
