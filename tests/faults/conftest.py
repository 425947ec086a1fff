"""Fixtures of the fault suite: one ``crescent up`` per module, healthy before every test.

A module sets ``STACK_PLAN`` (a ``StackPlan``) to start its platform differently. Tests that
break a service leave it to the launcher to bring it back; the next test starts only once every
service answers /health, the gateway sees every engine and a request succeeds, so a service that
never comes back fails that test's set-up, loudly.
"""

from __future__ import annotations

import logging

import pytest

from tests.faults.load import LoadClient
from tests.faults.stack import FaultStack, StackPlan

RECOVERY_TIMEOUT_S = 90  # a restarted engine loads its model again: seconds on a shared CPU


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    plan = getattr(request.module, "STACK_PLAN", StackPlan())
    running = FaultStack.start(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]), plan)
    yield running
    running.stop()


@pytest.fixture
def healthy_stack(stack: FaultStack) -> FaultStack:
    seconds = stack.wait_healthy(RECOVERY_TIMEOUT_S)
    logging.getLogger(__name__).info("stack healthy after %.1f s", seconds)
    return stack


@pytest.fixture
async def client(healthy_stack: FaultStack):
    async with LoadClient(healthy_stack.url, healthy_stack.model) as load_client:
        yield load_client
